"""The one training function: CLI runs, Ray trials and production jobs all call `train`.

config -> data -> model -> privacy plan -> optimizer (+ Opacus) -> epochs -> metrics.
Tracking is not done here: callers pass ``on_epoch_end`` (MLflow logging, Ray reports,
checkpoints) and receive a `TrainResult`.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dpivon.config import TrainConfig
from dpivon.data import DataSplits, load_splits
from dpivon.errors import DpivonError
from dpivon.evaluation import Evaluation, Posterior, evaluate_as_configured
from dpivon.metrics import ReliabilityDiagram, json_number, reliability_diagram
from dpivon.models import build_model
from dpivon.optim.build import build_optimizer
from dpivon.optim.ivon import DPIVON, IVON
from dpivon.privacy.engine import PrivacyPlan, PrivateTraining, make_private, plan_privacy
from dpivon.privacy.noise import (
    RESEARCH_MODE_WARNING,
    Randomness,
    SeededRandomness,
    mechanism_randomness,
    without_key,
)
from dpivon.privacy.sampling import PoissonBatches, ShuffledBatches
from dpivon.privacy.tuning import TrialMechanism, check_tuning_cost, compose_with_tuning
from dpivon.privacy.validation import private_validation_scores
from dpivon.saved_files import read_saved, versioned

# Metrics computed on raw training batches: a private run's epsilon does not cover them.
NOT_COVERED_METRICS = ("train_loss",)


def released_metrics(
    config: TrainConfig, metrics: dict[str, float], *, train_loss: bool = False
) -> dict[str, float]:
    """What a run logs of one epoch's ``metrics``: a private run's raw training loss only
    when asked (``train_loss``; the caller marks it as not covered by the run's epsilon)."""
    if not config.is_private or train_loss:
        return dict(metrics)
    return {k: v for k, v in metrics.items() if k not in NOT_COVERED_METRICS}


def parameters_finite(model: nn.Module) -> bool:
    """Divergence as a private run may see it: from the parameters (post-processing of the
    privatised gradients), never from the raw batch loss, which is not DP."""
    return bool(torch.stack([p.detach().isfinite().all() for p in model.parameters()]).all())


# Steps between two measurements of DP-IVON's curvature_update_share (and the first step of
# each epoch): it costs a second mean update per tensor, a tenth of DP-IVON's step.
UPDATE_SHARE_EVERY = 10
# Where a run's time goes (`dpivon train --profile`): loading the data and drawing and
# moving batches, building model, optimizer and privacy plan, optimizer steps, the
# per-epoch validation, the curvature diagnostics, building resumable checkpoints, the
# rest of the epoch callbacks (MLflow writes in the CLI, with the final ones; saving and
# reporting checkpoints to Ray in trials) and the final test.
PHASES = (
    "data", "setup", "train", "validation", "diagnostics", "checkpoint", "logging", "test",
)  # fmt: skip


class PhaseTimes:
    """Seconds spent in each of `PHASES`; on CUDA a phase ends when the device is done."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.device: torch.device | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] += time.perf_counter() - start


def timed_batches(
    loader: Iterable, device: torch.device, phases: PhaseTimes
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches on ``device``; drawing and moving them counts as "data"."""
    batches = iter(loader)
    while True:
        with phases.phase("data"):
            batch = next(batches, None)
            if batch is not None:
                x, y = (t.to(device) for t in batch)
        if batch is None:
            return
        yield x, y


class TrainingDiverged(DpivonError):
    """The parameters became NaN or infinite. ``privacy`` holds the mechanism of the planned run
    (noise_multiplier, sample_rate, steps: all of it, the conservative count) for private
    runs: a diverged trial spent budget too, and the tuning cost must count it."""

    def __init__(self, message: str, privacy: dict[str, float] | None = None):
        super().__init__(message)
        self.privacy = privacy or {}


@dataclass(frozen=True)
class StepReport:
    """What a progress display sees after each training step."""

    task: str
    done: int  # steps so far, of `total`
    total: int
    status: str


StepCallback = Callable[[StepReport], None]
# More validation scores of an epoch's model and posterior (`dpivon.shift`'s under shift)
ValidationScores = Callable[[nn.Module, Posterior | None], dict[str, float]]


@dataclass
class EpochReport:
    """What callbacks see after each epoch; ``checkpoint()`` builds resumable state lazily."""

    epoch: int
    metrics: dict[str, float]
    checkpoint: Callable[[], dict]


@dataclass
class TrainResult:
    config: TrainConfig
    privacy: PrivacyPlan | None
    epsilon_spent: float | None
    steps: int
    train_images: int  # the records the run trained on (the accountant's dataset size)
    history: list[dict[str, float]]
    val: dict[str, float]
    test: dict[str, float] | None
    test_reliability: ReliabilityDiagram | None
    model: nn.Module
    posterior: Posterior | None
    wall_time_s: float
    extra: dict[str, float] = field(default_factory=dict)
    engine: str | None = None  # the clipping engine ``auto`` resolved to (private runs)
    phases: PhaseTimes = field(default_factory=PhaseTimes)

    def summary(self) -> dict[str, float | int | str | None]:
        """Flat, JSON-ready record of the run (the ``--json`` output)."""
        c, plan = self.config, self.privacy
        out: dict[str, float | int | str | None] = {
            "optimizer": c.optimizer.name,
            "model": c.model.name,
            "dataset": c.data.dataset,
            "epochs": c.training.epochs,
            "lr": c.optimizer.lr,
            "target_epsilon": plan.target_epsilon if plan else None,
            "epsilon_spent": self.epsilon_spent,
            "delta": c.privacy.delta if plan else None,
            "accountant": plan.accountant if plan else None,
            "noise_multiplier": plan.noise_multiplier if plan else 0.0,
            "sample_rate": plan.sample_rate if plan else None,
            "steps": self.steps,
            "train_images": self.train_images,
            "max_grad_norm": c.privacy.max_grad_norm if plan else None,
            "engine": self.engine,
            "batch_size": c.training.batch_size,
            "wall_time_s": self.wall_time_s,
        }
        out.update(self.tuning_summary())
        out.update({f"val_{k}": v for k, v in self.val.items()})
        if self.test is not None:
            out.update({f"test_{k}": v for k, v in self.test.items()})
        out.update(self.extra)
        return {k: json_number(v) for k, v in out.items()}

    def tuning_summary(self) -> dict[str, float | str]:
        """What this run's epsilon covers; for a config chosen by a sweep also the tuning
        epsilon and its composition with this run, which covers the released model (both
        used the same records)."""
        tuning, plan = self.config.privacy.tuning, self.privacy
        if plan is None:
            return {}
        if self.config.privacy.research_mode:
            return {"epsilon_covers": f"nothing: {RESEARCH_MODE_WARNING}"}
        if tuning is None:
            validation = (
                "validation scores are noised (validation records covered too)"
                if self.config.evaluation.val_noise_multiplier > 0
                else "the validation scores are exact (validation records unprotected)"
            )
            return {
                "epsilon_covers": (
                    "epsilon_spent covers the model (mean and posterior) and the DP "
                    "diagnostics of this run for the training records (add or remove one), "
                    "if its hyper-parameters were chosen without those records; the training "
                    f"loss is not covered and {validation}"
                )
            }
        production = TrialMechanism(plan.noise_multiplier, plan.sample_rate, self.steps)
        return {
            "tuning_epsilon": tuning.quoted_epsilon,
            "epsilon_with_tuning": compose_with_tuning(production, tuning.quoted_rdp, plan.delta),
            "epsilon_covers": (
                f"epsilon_with_tuning covers the released model: its hyper-parameters were "
                f"selected by sweep {tuning.sweep!r} ({tuning.group}) on the same records; "
                f"epsilon_spent covers this training alone"
            ),
        }


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DpivonError(f"device {name!r} requested but CUDA is not available; use cpu or auto")
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise DpivonError(
                f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                "(cuda:0 ...); use one of them, or auto"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise DpivonError(f"device {name!r} requested but MPS is not available; use cpu or auto")
    return device


def synthetic_sizes(config: TrainConfig) -> tuple[int, int]:
    """(train, test) images of a synthetic data set: the test set a fifth of the training."""
    return config.data.synthetic_size, max(config.data.synthetic_size // 5, 10)


def load_data(config: TrainConfig) -> DataSplits:
    return load_splits(
        config.data.dataset,
        data_path=config.data.data_path,
        val_size=config.data.val_size,
        per_class=config.data.per_class,
        seed=config.split_seed,
        synthetic_sizes=synthetic_sizes(config),
    )


@dataclass
class TrainingSetup:
    """The live training objects; ``model`` is the unwrapped network (shared parameters).

    ``randomness`` draws the batches (and, for private runs, the Poisson masks and the DP
    noise: secure unless research mode); ``criterion`` is the loss whose backward the
    engine needs.
    """

    model: nn.Module
    trained_module: nn.Module
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    ivon: IVON | None
    loader: PoissonBatches | ShuffledBatches
    randomness: Randomness
    private: PrivateTraining | None


def check_batch(config: TrainConfig, n_train: int) -> None:
    if config.training.batch_size > n_train:
        raise DpivonError(
            f"batch size {config.training.batch_size} is larger than the training set "
            f"({n_train} examples); lower --batch-size or use more data"
        )


def check_fits(config: TrainConfig, data: DataSplits) -> None:
    """What would fail once training starts, checked before a run is opened: a batch no
    larger than the training set, the device, and (private runs) the budget's plan."""
    n_train = len(data.train)
    check_batch(config, n_train)
    resolve_device(config.runtime.device)
    if config.is_private:
        privacy_plan(config, n_train)
    if (tuning := config.privacy.tuning) is not None:
        check_tuning_cost(tuning.quoted_rdp, tuning.quoted_epsilon, config.privacy.delta)


def privacy_plan(config: TrainConfig, n_train: int) -> PrivacyPlan:
    """The noise and sampling that spend ``config``'s budget over ``n_train`` records."""
    return plan_privacy(
        target_epsilon=config.privacy.epsilon,
        delta=config.privacy.delta,
        max_grad_norm=config.privacy.max_grad_norm,
        accountant=config.privacy.accountant,
        dataset_size=n_train,
        batch_size=config.training.batch_size,
        epochs=config.training.epochs,
        steps_per_epoch=config.training.steps_per_epoch,
        noise_multiplier=config.privacy.fixed_noise_multiplier,
    )


def build_training(config: TrainConfig, data: DataSplits, device: torch.device) -> TrainingSetup:
    """Model, optimizer and batches for ``config``, private ones wired through Opacus."""
    check_batch(config, len(data.train))
    features, labels = (t.to(device) for t in data.train.tensors)
    n_train = len(labels)
    model = build_model(config.model.name).to(device)
    plan = None
    if config.is_private:
        plan = privacy_plan(config, n_train)
    optimizer = build_optimizer(
        config.optimizer,
        model.parameters(),
        dataset_size=n_train,
        grad_noise_std=plan.grad_noise_std if plan else 0.0,
    )
    ivon = optimizer if isinstance(optimizer, IVON) else None
    # DP noise, Poisson masks and noised validation scores (in non-private runs too)
    randomness = mechanism_randomness(
        config.runtime.seed, device, research=config.privacy.research_mode
    )
    if plan is None:  # no DP for the training records: the batches follow the seed
        shuffling = SeededRandomness(config.runtime.seed, device).generator
        loader = ShuffledBatches(
            features, labels, batch_size=config.training.batch_size, generator=shuffling
        )
        return TrainingSetup(
            model, model, optimizer, nn.CrossEntropyLoss(), ivon, loader, randomness, None
        )
    private = make_private(
        model,
        optimizer,
        features,
        labels,
        plan,
        engine=config.privacy.engine,
        randomness=randomness,
    )
    return TrainingSetup(
        model,
        private.module,
        private.optimizer,
        private.criterion,
        ivon,
        private.loader,
        randomness,
        private,
    )


def _lr_scheduler(config: TrainConfig, setup: TrainingSetup) -> torch.optim.lr_scheduler.LambdaLR:
    total = max(config.training.epochs * len(setup.loader), 1)
    base = setup.ivon if setup.ivon is not None else setup.optimizer
    if isinstance(base, torch.optim.Optimizer) and hasattr(base, "original_optimizer"):
        base = base.original_optimizer
    if config.training.lr_schedule == "cosine":
        return torch.optim.lr_scheduler.LambdaLR(
            base, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
        )
    return torch.optim.lr_scheduler.LambdaLR(base, lambda step: 1.0)


def train_step(setup: TrainingSetup, x: torch.Tensor, y: torch.Tensor, mc_samples: int) -> float:
    """One optimizer step; for IVON, backprop at ``mc_samples`` posterior draws first."""
    if setup.ivon is None:
        setup.optimizer.zero_grad()
        loss = setup.criterion(setup.trained_module(x), y)
        loss.backward()
        setup.optimizer.step()
        return loss.item()
    total = 0.0
    for _ in range(mc_samples):
        with setup.ivon.sampled_params(train=True):
            setup.optimizer.zero_grad()
            loss = setup.criterion(setup.trained_module(x), y)
            loss.backward()
        total += loss.item()
    setup.optimizer.step()
    return total / mc_samples


def _rng_states(setup: TrainingSetup) -> dict:
    """Every random stream a run draws from: resuming continues each instead of replaying.

    In secure mode the randomness's state is its key, as sensitive as the training data; the
    checkpoint lives in the sweep's private storage and is never logged or exported.
    """
    states = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "randomness": setup.randomness.state_dict(),
    }
    if isinstance(setup.loader, ShuffledBatches):
        states["shuffling"] = setup.loader.generator.get_state()
    return states


def _restore_rng_states(states: dict, setup: TrainingSetup) -> None:
    if "randomness" not in states:
        raise DpivonError(
            "this checkpoint predates secure noise (it holds a seeded generator, no noise "
            "key): it cannot resume; start the run again"
        )
    torch.set_rng_state(states["torch"])
    if states["cuda"]:
        torch.cuda.set_rng_state_all(states["cuda"])
    setup.randomness.load_state_dict(states["randomness"])
    if isinstance(setup.loader, ShuffledBatches):
        setup.loader.generator.set_state(states["shuffling"])


def _checkpoint_state(epoch: int, setup: TrainingSetup, scheduler, history: list[dict]) -> dict:
    return {
        "epoch": epoch,
        "model": setup.model.state_dict(),
        "optimizer": setup.optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "accountant": setup.private.accountant.state_dict() if setup.private else None,
        "rng": _rng_states(setup),
        "history": list(history),
    }


def releasable_state(config: TrainConfig, state: dict) -> dict:
    """A checkpoint ``state`` (`EpochReport.checkpoint`) that may be stored where the run's
    releases are. Model, optimizer and accountant states are outputs of the private
    mechanism (post-processing of the noised gradients; DP-SGD's guarantee covers every
    iterate) and the torch generators draw only initialisation and posterior samples; what
    remains private is dropped: the noise key (the resumed run continues under a fresh one)
    and the history's metrics that the run's epsilon does not cover."""
    rng = {**state["rng"], "randomness": without_key(state["rng"]["randomness"])}
    history = [released_metrics(config, metrics) for metrics in state["history"]]
    return {**state, "rng": rng, "history": history}


def _restore(state: dict, setup: TrainingSetup, scheduler) -> tuple[int, list[dict]]:
    setup.model.load_state_dict(state["model"])
    setup.optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if setup.private is not None:
        setup.private.accountant.load_state_dict(state["accountant"])
    _restore_rng_states(state["rng"], setup)
    return state["epoch"], list(state["history"])


class EpochCheckpoint:
    """A single run's resumable state in one file, rewritten whole after every epoch.

    Holds what ``train(resume_state=...)`` needs, the config it belongs to and the MLflow run
    it reports to; a file of another config is refused rather than resumed. Like a sweep's
    checkpoints it holds every generator state: keep it as private as the training data.
    """

    def __init__(self, path: Path, config: TrainConfig) -> None:
        self.path, self.config = path, config
        self.run_id: str | None = None
        self.state: dict | None = None
        if os.path.lexists(path):  # a FIFO or a symlink loop is refused, not opened
            fields = {"config": dict, "mlflow_run_id": str, "training": dict}
            saved = read_saved(path, "checkpoint", fields)
            if saved["config"] != config.flat():
                raise DpivonError(
                    f"checkpoint {path} is of another run configuration; delete it or point "
                    "--checkpoint elsewhere"
                )
            self.run_id, self.state = saved["mlflow_run_id"], saved["training"]

    @property
    def epoch(self) -> int:
        return self.state["epoch"] if self.state is not None else 0

    def save(self, run_id: str, state: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".tmp")
        payload = {"config": self.config.flat(), "mlflow_run_id": run_id, "training": state}
        torch.save(versioned(payload), partial)
        partial.replace(self.path)  # atomic: an interrupted save leaves the last epoch's


def _posterior(setup: TrainingSetup) -> Posterior | None:
    return Posterior.from_ivon(setup.model, setup.ivon) if setup.ivon else None


def _validation_scores(config: TrainConfig, setup: TrainingSetup, val: Evaluation) -> dict:
    """The validation scores a run releases: exact, or with ``val_noise_multiplier`` only
    the Gaussian-noised accuracy and ECE (the exact ones, NLL and Brier are not released)."""
    if config.evaluation.val_noise_multiplier == 0:
        return val.metrics
    diagram = reliability_diagram(val.probs, val.labels, config.evaluation.ece_bins)
    return private_validation_scores(
        diagram.bin_sums(), config.evaluation.val_noise_multiplier, setup.randomness
    )


def _diverged(config: TrainConfig, setup: TrainingSetup, epoch: int) -> TrainingDiverged:
    """The error of a run whose parameters are no longer finite, with the planned mechanism
    of a private run (the tuning cost counts a diverged trial too)."""
    plan = setup.private.plan if setup.private is not None else None
    return TrainingDiverged(
        f"training diverged at epoch {epoch}: the parameters are no longer "
        f"finite; lower the learning rate (lr={config.optimizer.lr})",
        privacy={
            "noise_multiplier": plan.noise_multiplier,
            "sample_rate": plan.sample_rate,
            "steps": plan.steps,
        }
        if plan is not None
        else None,
    )


class _TrainingRun:
    """One call of `train`, as the phases it runs: set up, restore (a resumed run), one
    epoch at a time (its steps, then its evaluation and report), finish (the test and the
    result). Each is timed under `PHASES` in ``phases``."""

    def __init__(
        self,
        config: TrainConfig,
        data: DataSplits,
        device: torch.device,
        setup: TrainingSetup,
        phases: PhaseTimes,
        on_step: StepCallback | None,
    ) -> None:
        self.config, self.data, self.device, self.setup = config, data, device, setup
        self.phases, self.on_step = phases, on_step
        self.scheduler = _lr_scheduler(config, setup)
        self.dp_ivon = setup.ivon if isinstance(setup.ivon, DPIVON) else None
        self.first_epoch = 0
        self.history: list[dict[str, float]] = []
        self.total_steps = config.training.epochs * len(setup.loader)
        self.steps_done = 0
        self.posterior: Posterior | None = None
        self.val: dict[str, float] | None = None  # the last epoch's released scores
        self.extra_validation: ValidationScores | None = None

    @classmethod
    def set_up(
        cls,
        config: TrainConfig,
        data: DataSplits | None,
        phases: PhaseTimes,
        on_step: StepCallback | None,
    ) -> _TrainingRun:
        """Seeds, device, data (phase "data"), model, optimizer and privacy ("setup")."""
        seed_everything(config.runtime.seed)
        device = resolve_device(config.runtime.device)
        phases.device = device
        with phases.phase("data"):
            data = data if data is not None else load_data(config)
        with phases.phase("setup"):
            setup = build_training(config, data, device)
            return cls(config, data, device, setup, phases, on_step)

    def restore(self, state: dict) -> None:
        """Continue a checkpointed run after its last epoch (phase "setup")."""
        with self.phases.phase("setup"):
            self.first_epoch, self.history = _restore(state, self.setup, self.scheduler)
        self.steps_done = self.first_epoch * len(self.setup.loader)

    def report_step(self, status: str) -> None:
        if self.on_step is not None:
            name = self.config.optimizer.name
            self.on_step(StepReport(name, self.steps_done, self.total_steps, status))

    def train_epoch(self, epoch: int) -> tuple[list[float], list[dict[str, float]]]:
        """The epoch's optimizer steps: their losses and DPIVON's per-step diagnostics."""
        setup, phases = self.setup, self.phases
        setup.trained_module.train()
        losses, step_diagnostics = [], []
        for step, (x, y) in enumerate(timed_batches(setup.loader, self.device, phases)):
            if self.dp_ivon is not None:
                self.dp_ivon.track_update_share = step % UPDATE_SHARE_EVERY == 0
            with phases.phase("train"):
                loss = train_step(setup, x, y, self.config.optimizer.samples_per_step)
            if not parameters_finite(setup.model):
                raise _diverged(self.config, setup, epoch)
            losses.append(loss)
            step_diagnostics.append(getattr(setup.ivon, "step_diagnostics", {}))
            self.scheduler.step()
            self.steps_done += 1
            self.report_step(f"epoch {epoch}")
        return losses, step_diagnostics

    def evaluate_epoch(
        self, epoch: int, losses: list[float], step_diagnostics: list[dict[str, float]]
    ) -> dict[str, float]:
        """What the epoch releases: training loss, validation scores (phase "validation"),
        the privacy spent so far and, for IVON, the curvature ("diagnostics")."""
        config, setup, phases = self.config, self.setup, self.phases
        self.posterior = _posterior(setup)
        with phases.phase("validation"):
            val_samples = config.evaluation.val_bma_samples
            val = evaluate_as_configured(
                config, setup.model, self.data.val, self.posterior, bma_samples=val_samples
            )
            self.val = _validation_scores(config, setup, val)
            if self.extra_validation is not None:  # e.g. a sweep's objective under shift
                self.val = {**self.val, **self.extra_validation(setup.model, self.posterior)}
        metrics = {"epoch": epoch, "train_loss": float(np.nanmean(losses)) if losses else 0.0}
        metrics.update({f"val_{k}": v for k, v in self.val.items()})
        if config.evaluation.test_every_epoch:
            with phases.phase("test"):
                test = evaluate_as_configured(
                    config, setup.model, self.data.test, self.posterior, bma_samples=val_samples
                )
            metrics["epoch_test_accuracy"] = test.metrics["accuracy"]
        if setup.private is not None:
            plan = setup.private.plan
            metrics.update(
                epsilon_spent=setup.private.epsilon_spent(),
                noise_multiplier=plan.noise_multiplier,
                sample_rate=plan.sample_rate,
                steps=setup.private.steps_taken,
            )
        if setup.ivon is not None:
            with phases.phase("diagnostics"):
                metrics.update(setup.ivon.curvature_diagnostics())
                # per-step diagnostics (projected_fraction, curvature_update_share) as
                # means over the epoch's steps that computed them, not the last step's
                keys = dict.fromkeys(k for d in step_diagnostics for k in d)
                metrics.update(
                    {k: float(np.mean([d[k] for d in step_diagnostics if k in d])) for k in keys}
                )
        return metrics

    def checkpoint(self, epoch: int) -> dict:
        """The resumable state after ``epoch`` (phase "checkpoint")."""
        with self.phases.phase("checkpoint"):
            return _checkpoint_state(epoch, self.setup, self.scheduler, self.history)

    def end_epoch(
        self,
        epoch: int,
        metrics: dict[str, float],
        on_epoch_end: Callable[[EpochReport], None] | None,
    ) -> None:
        """Record the epoch and hand it to ``on_epoch_end`` (phase "logging")."""
        self.history.append(metrics)
        self.report_step(f"epoch {epoch} val acc {self.val['accuracy']:.3f}")
        if on_epoch_end is None:
            return
        phases = self.phases
        checkpoint_s = phases.seconds["checkpoint"]
        with phases.phase("logging"):
            on_epoch_end(EpochReport(epoch, metrics, lambda: self.checkpoint(epoch)))
        # a checkpoint the callback built is a phase of its own
        phases.seconds["logging"] -= phases.seconds["checkpoint"] - checkpoint_s

    def test(self) -> tuple[dict[str, float], ReliabilityDiagram]:
        """The final test's metrics and reliability diagram (phase "test")."""
        config, model = self.config, self.setup.model
        with self.phases.phase("test"):
            result = evaluate_as_configured(config, model, self.data.test, self.posterior)
            diagram = reliability_diagram(result.probs, result.labels, config.evaluation.ece_bins)
        return result.metrics, diagram

    def finish(self, *, evaluate_test: bool, started: float) -> TrainResult:
        """The test (if asked) and the run's result; the model moves to the CPU."""
        if self.val is None:  # resumed after the last epoch: the scores that epoch released
            self.posterior = _posterior(self.setup)
            last = self.history[-1]
            self.val = {k.removeprefix("val_"): v for k, v in last.items() if k.startswith("val_")}
        test, diagram = self.test() if evaluate_test else (None, None)
        private = self.setup.private
        return TrainResult(
            config=self.config,
            privacy=private.plan if private else None,
            epsilon_spent=private.epsilon_spent() if private else None,
            steps=private.steps_taken if private else self.total_steps,
            train_images=len(self.data.train),
            history=self.history,
            val=self.val,
            test=test,
            test_reliability=diagram,
            model=self.setup.model.cpu(),
            posterior=self.posterior,
            wall_time_s=time.perf_counter() - started,
            engine=private.engine if private else None,
            phases=self.phases,
        )


def train(
    config: TrainConfig,
    *,
    data: DataSplits | None = None,
    on_epoch_end: Callable[[EpochReport], None] | None = None,
    resume_state: dict | None = None,
    evaluate_test: bool = True,
    on_step: StepCallback | None = None,
    phases: PhaseTimes | None = None,
    extra_validation: ValidationScores | None = None,
) -> TrainResult:
    """Train ``config`` and evaluate it; see the module docstring for the pipeline.
    ``phases`` (a fresh one if None) accumulates the seconds of each phase;
    ``extra_validation`` adds its scores of the model and posterior to each epoch's
    validation scores (``val_<key>``)."""
    started = time.perf_counter()
    run = _TrainingRun.set_up(config, data, phases if phases is not None else PhaseTimes(), on_step)
    run.extra_validation = extra_validation
    if resume_state is not None:
        run.restore(resume_state)
    for epoch in range(run.first_epoch + 1, config.training.epochs + 1):
        losses, step_diagnostics = run.train_epoch(epoch)
        metrics = run.evaluate_epoch(epoch, losses, step_diagnostics)
        run.end_epoch(epoch, metrics, on_epoch_end)
    return run.finish(evaluate_test=evaluate_test, started=started)
