"""Predictive distributions: at the posterior mean, or Bayesian model averaging (BMA).

For the IVON family the predictive of record is BMA: over ``bma_samples`` posterior draws
(default 16; the IVON authors use up to 64, 16-64 is enough) for the final test and the
logged model, over ``val_bma_samples`` (default 4) for the per-epoch validation that the
sweep's objectives and ASHA read. The mean prediction is reported beside it. Other
optimizers have a point estimate only.

How evaluation runs is an `EvaluationPlan`: the batch size, the memory format and how many
posterior draws one call evaluates (a ``torch.func.vmap`` over stacked parameters, or one
draw after another), chosen per (device, model, threads) by a short measurement and cached
in dpivon's cache folder (`evaluation_plan`). Every forward runs under inference mode. The
plan changes how the numbers are computed, never which draws are taken.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.utils.data import TensorDataset

from dpivon.config import TrainConfig
from dpivon.data import default_cache_dir
from dpivon.metrics import classification_metrics
from dpivon.optim.ivon import IVON, posterior_std

PLAN_CACHE_FILE = "evaluation-plans.json"
# Candidates of the measurement, smallest first; a larger batch is tried only while it helps.
CPU_BATCH_SIZES = (32, 64, 128, 256, 512)
GPU_BATCH_SIZES = (256, 512, 1024, 2048, 4096)
CPU_DRAWS_PER_CALL = (1, 4)
GPU_DRAWS_PER_CALL = (1, 4, 16)
MEASURE_BUDGET_S = 4.0  # a slow model on a slow device stops measuring early

Params = dict[str, Tensor]


@dataclass
class Posterior:
    """Diagonal Gaussian N(m, 1 / (ess (h + delta))): the mean lives in the model's
    parameters, ``hess`` maps parameter names to h."""

    hess: dict[str, Tensor]
    ess: float
    weight_decay: float

    def std(self, name: str) -> Tensor:
        return posterior_std(self.hess[name], self.ess, self.weight_decay)

    def state_dict(self) -> dict:
        return {"hess": self.hess, "ess": self.ess, "weight_decay": self.weight_decay}

    @classmethod
    def from_state_dict(cls, state: dict) -> Posterior:
        return cls(state["hess"], float(state["ess"]), float(state["weight_decay"]))

    @classmethod
    def from_ivon(cls, model: nn.Module, optimizer: IVON) -> Posterior:
        (group,) = optimizer.param_groups  # dpivon builds one group per model
        hess = {
            name: optimizer.state[p]["hess"].detach().clone()
            for name, p in model.named_parameters()
        }
        return cls(hess, float(group["ess"]), float(group["weight_decay"]))


# --- posterior draws ------------------------------------------------------------------------


def _means_and_stds(model: nn.Module, posterior: Posterior) -> tuple[Params, Params]:
    with torch.no_grad():
        named = list(model.named_parameters())
        means = {name: p.detach().clone() for name, p in named}
        stds = {name: posterior.std(name).to(p.device) for name, p in named}
    return means, stds


def draw_parameters(means: Params, stds: Params, generator: torch.Generator | None) -> Params:
    """theta = m + s * z, one ``randn`` per tensor in parameter order: the draw sequence of a
    seeded generator is the same whichever way the draws are evaluated."""
    with torch.no_grad():
        return {
            name: mean + torch.randn(
                mean.shape, generator=generator, device=mean.device, dtype=mean.dtype
            ) * stds[name]
            for name, mean in means.items()
        }


@contextmanager
def posterior_draws(
    model: nn.Module, posterior: Posterior, generator: torch.Generator | None = None
) -> Iterator[Callable[[], None]]:
    """Inside the block, ``draw()`` puts a fresh theta = m + s * z into the parameters; after
    it they hold the mean m again. m and s are computed once for all draws."""
    means, stds = _means_and_stds(model, posterior)
    named = dict(model.named_parameters())

    @torch.no_grad()
    def draw() -> None:
        for name, theta in draw_parameters(means, stds, generator).items():
            named[name].copy_(theta)

    try:
        yield draw
    finally:
        with torch.no_grad():
            for name, p in named.items():
                p.copy_(means[name])


# --- the plan: batch size, memory format, draws per call -----------------------------------


@dataclass(frozen=True)
class EvaluationPlan:
    """How evaluation runs on one device: images per forward call (per draw), channels-last
    images and weights or not, and posterior draws per call (1: one after another; more: one
    ``vmap`` over the draws' stacked parameters)."""

    batch_size: int
    channels_last: bool = False
    draws_per_call: int = 1


def _formatted(tensor: Tensor, channels_last: bool) -> Tensor:
    if channels_last and tensor.dim() == 4:
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor


def _softmax_at(model: nn.Module, params: Params, images: Tensor, plan: EvaluationPlan) -> Tensor:
    """Softmax probabilities of ``images`` (on the model's device) at ``params``."""
    params = {name: _formatted(t, plan.channels_last) for name, t in params.items()}
    images = _formatted(images, plan.channels_last)
    with torch.inference_mode():
        chunks = [
            torch.softmax(functional_call(model, params, (batch,)).float(), dim=1)
            for batch in images.split(plan.batch_size)
        ]
    return torch.cat(chunks).clone()  # an ordinary tensor, usable outside inference mode


def _softmax_of_draws(
    model: nn.Module, draws: list[Params], images: Tensor, plan: EvaluationPlan
) -> list[Tensor]:
    """Softmax probabilities at each of ``draws``: in one vmapped call per batch when there
    are several (contiguous layout: vmap stacks the weights)."""
    if len(draws) == 1:
        return [_softmax_at(model, draws[0], images, plan)]
    stacked = {name: torch.stack([d[name] for d in draws]) for name in draws[0]}

    def probs(params: Params, batch: Tensor) -> Tensor:
        return torch.softmax(functional_call(model, params, (batch,)).float(), dim=1)

    batched = vmap(probs, in_dims=(0, None))
    with torch.inference_mode():
        chunks = [batched(stacked, batch) for batch in images.split(plan.batch_size)]
    return list(torch.cat(chunks, dim=1).clone().unbind(0))


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()}x{os.cpu_count()}"


def _plan_key(model: nn.Module, device: torch.device) -> str:
    shapes = ",".join("x".join(map(str, p.shape)) for p in model.parameters())
    return (
        f"{device.type}:{_device_name(device)}|{type(model).__name__}|{shapes}|"
        f"threads={torch.get_num_threads()}|torch={torch.__version__}"
    )


def _images_per_s(
    model: nn.Module, params: Params, device: torch.device, plan: EvaluationPlan
) -> float:
    """Forward images per second (draws x images) of one call of ``plan``, after a warm-up."""
    # zeros, not randn: measuring must not draw from the global generator, or a run that
    # measures (the first on a machine) would train differently from one that reads the cache
    images = torch.zeros(plan.batch_size, 3, 32, 32, device=device)
    draws = [params] * plan.draws_per_call
    _softmax_of_draws(model, draws, images, plan)  # kernels chosen, memory allocated
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    _softmax_of_draws(model, draws, images, plan)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return plan.batch_size * plan.draws_per_call / (time.perf_counter() - start)


def measure_evaluation_plan(model: nn.Module, device: torch.device) -> tuple[EvaluationPlan, float]:
    """The fastest plan for ``model`` on ``device`` and its images per second.

    Batch sizes ascend while they help (a slower size ends the format's search), for the
    contiguous and the channels-last layout with one draw per call, then more draws per call
    at the best batch size; a candidate that would not finish within `MEASURE_BUDGET_S` at
    the best rate so far is not tried.
    """
    gpu = device.type == "cuda"
    params = {name: p.detach() for name, p in model.named_parameters()}
    deadline = time.perf_counter() + MEASURE_BUDGET_S
    rates: dict[EvaluationPlan, float] = {}
    with _eval_mode(model):
        for channels_last in (False, True):
            best = 0.0
            for batch_size in GPU_BATCH_SIZES if gpu else CPU_BATCH_SIZES:
                # two calls of this size, at the best rate so far, must fit in the budget
                left = deadline - time.perf_counter()
                if rates and 2 * batch_size / max(rates.values()) > left:
                    break
                plan = EvaluationPlan(batch_size, channels_last)
                rates[plan] = _images_per_s(model, params, device, plan)
                if rates[plan] < best:
                    break
                best = rates[plan]
        loop = max(rates, key=rates.__getitem__)
        for draws in (GPU_DRAWS_PER_CALL if gpu else CPU_DRAWS_PER_CALL)[1:]:
            left = deadline - time.perf_counter()
            if 2 * draws * loop.batch_size / rates[loop] > left:
                break
            plan = EvaluationPlan(loop.batch_size, False, draws)
            rates[plan] = _images_per_s(model, params, device, plan)
    fastest = max(rates, key=rates.__getitem__)
    return fastest, rates[fastest]


_plans: dict[tuple[Path, str], EvaluationPlan] = {}  # this process's plans, by cache


def evaluation_plan(model: nn.Module, device: torch.device | None = None) -> EvaluationPlan:
    """The cached plan for ``model`` on ``device`` (its parameters' device by default),
    measured on first use (a few seconds) and kept in ``$DPIVON_CACHE/evaluation-plans.json``
    for every later process on this machine."""
    device = device or next(model.parameters()).device
    key = _plan_key(model, device)
    path = default_cache_dir() / PLAN_CACHE_FILE
    if (path, key) in _plans:
        return _plans[path, key]
    stored = _read_plans(path)
    plan = _stored_plan(stored.get(key))
    if plan is None:
        plan, rate = measure_evaluation_plan(model, device)
        stored[key] = {"plan": asdict(plan), "images_per_s": round(rate, 1)}
        _write_plans(path, stored)
    _plans[path, key] = plan
    return plan


def _stored_plan(entry: object) -> EvaluationPlan | None:
    """The plan a cache entry holds; None for a missing or malformed one."""
    try:
        plan = EvaluationPlan(**entry["plan"])  # type: ignore[index]
    except (TypeError, KeyError):
        return None
    fields = (plan.batch_size, plan.draws_per_call)
    valid = all(isinstance(v, int) and v >= 1 for v in fields)
    return plan if valid and isinstance(plan.channels_last, bool) else None


def _read_plans(path: Path) -> dict:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measure again
    return stored if isinstance(stored, dict) else {}


def _write_plans(path: Path, plans: dict) -> None:
    """Via a temp file and a rename: a concurrent reader never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as tmp:
            json.dump(plans, tmp, indent=1)
        os.replace(tmp.name, path)
    except OSError:
        pass  # a read-only cache: measure again next time


# --- predictives ------------------------------------------------------------------------------


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[torch.device]:
    """Evaluation mode (training hooks stay idle) for the block; yields the model's device."""
    was_training = model.training
    model.eval()
    try:
        yield next(model.parameters()).device
    finally:
        model.train(was_training)


def _plan(model: nn.Module, batch_size: int | None, draws_per_call: int | None) -> EvaluationPlan:
    plan = evaluation_plan(model)
    return EvaluationPlan(
        batch_size or plan.batch_size,
        plan.channels_last,
        draws_per_call or plan.draws_per_call,
    )


def predict_probs(model: nn.Module, images: Tensor, batch_size: int | None = None) -> Tensor:
    """Softmax probabilities at the current parameters, on the CPU."""
    plan = _plan(model, batch_size, 1)
    params = {name: p.detach() for name, p in model.named_parameters()}
    with _eval_mode(model) as device:
        return _softmax_at(model, params, images.to(device), plan).cpu()


def predict_bma(
    model: nn.Module,
    posterior: Posterior,
    images: Tensor,
    samples: int,
    *,
    generator: torch.Generator | None = None,
    batch_size: int | None = None,
    draws_per_call: int | None = None,
) -> Tensor:
    """Average of the softmax over ``samples`` posterior draws, on the CPU.

    The cost is ``samples`` forward passes (``draws_per_call`` of them per call) and nothing
    else that grows with the data: the images move to the device once, the running sum stays
    there, the mean and std are computed once. Draws and summation order are those of one
    draw after another, so a generator seed gives the same draws whatever the plan.
    """
    plan = _plan(model, batch_size, draws_per_call)
    means, stds = _means_and_stds(model, posterior)
    with _eval_mode(model) as device:
        images = _formatted(images.to(device), plan.channels_last)  # once for all draws
        total = None
        for first in range(0, samples, plan.draws_per_call):
            group = min(plan.draws_per_call, samples - first)
            draws = [draw_parameters(means, stds, generator) for _ in range(group)]
            for probs in _softmax_of_draws(model, draws, images, plan):
                total = probs if total is None else total.add_(probs)
    return (total / samples).cpu()


@dataclass
class Evaluation:
    """The predictive of record and its metrics (plus mean-prediction metrics for IVON)."""

    probs: Tensor
    labels: Tensor
    metrics: dict[str, float]


def evaluate(
    model: nn.Module,
    dataset: TensorDataset,
    *,
    posterior: Posterior | None,
    bma_samples: int,
    n_bins: int,
    seed: int,
) -> Evaluation:
    """Metrics of the predictive of record: BMA when there is a posterior and
    ``bma_samples > 0``, else the point prediction. ``mean_*`` keys hold the prediction at
    the mean whenever BMA is the record."""
    images, labels = dataset.tensors
    mean_probs = predict_probs(model, images)
    mean_metrics = classification_metrics(mean_probs, labels, n_bins)
    if posterior is None or bma_samples == 0:
        return Evaluation(mean_probs, labels, mean_metrics)
    # A fixed generator: the same posterior gives the same BMA, and the training RNG stream
    # is not consumed by evaluation.
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    bma_probs = predict_bma(model, posterior, images, bma_samples, generator=generator)
    metrics = classification_metrics(bma_probs, labels, n_bins)
    metrics.update({f"mean_{k}": v for k, v in mean_metrics.items()})
    return Evaluation(bma_probs, labels, metrics)


def evaluate_as_configured(
    config: TrainConfig,
    model: nn.Module,
    dataset: TensorDataset,
    posterior: Posterior | None,
    *,
    bma_samples: int | None = None,
) -> Evaluation:
    """`evaluate` as ``config`` says: its ECE bins and seed, and ``bma_samples`` posterior
    draws (default: the final test's ``evaluation.bma_samples``)."""
    return evaluate(
        model,
        dataset,
        posterior=posterior,
        bma_samples=config.evaluation.bma_samples if bma_samples is None else bma_samples,
        n_bins=config.evaluation.ece_bins,
        seed=config.runtime.seed,
    )
