"""The evaluation plan of a (device, model, threads): measured on first use in a few
seconds, then read from dpivon's cache folder (``evaluation-plans.json``) by every later
process on the machine. The plan changes how the numbers are computed, never which."""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from dpivon.data import default_cache_dir
from dpivon.evaluation.forward import EvaluationPlan, Params, eval_mode, softmax_of_draws

PLAN_CACHE_FILE = "evaluation-plans.json"
# Candidates of the measurement, smallest first; a larger batch is tried only while it helps.
CPU_BATCH_SIZES = (32, 64, 128, 256, 512)
GPU_BATCH_SIZES = (256, 512, 1024, 2048, 4096)
CPU_DRAWS_PER_CALL = (1, 4)
GPU_DRAWS_PER_CALL = (1, 4, 16)
MEASURE_BUDGET_S = 4.0  # a slow model on a slow device stops measuring early


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
    softmax_of_draws(model, draws, images, plan)  # kernels chosen, memory allocated
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    softmax_of_draws(model, draws, images, plan)
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
    with eval_mode(model):
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
