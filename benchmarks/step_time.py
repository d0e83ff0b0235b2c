"""Cost of a private step: every private optimizer x clipping engine against non-private Adam.

Every configuration is built by the `build_training` / `train_step` the training loop uses
(Poisson batches on the device, the engine's criterion, Opacus noise and accounting, IVON
posterior sampling), on the same model, expected batch size and synthetic data. For each
(model, batch size) all configurations live in one process and are timed round-robin, one
step of each per round, so drift in machine load hits them alike; ms/step is the median
after warm-up. Ratios compare configurations of the same model and batch size.

Peak memory is the most tensor memory one step holds at once beyond what existed before it
(model, optimizer state, data), one separate step per configuration: on CUDA
``torch.cuda.max_memory_allocated`` minus the allocation before the step; on CPU the
running sum of torch.profiler's allocation and free events (the RSS of a process holding
many configurations says little, and tracemalloc does not see torch's allocations). The
process runs with the settings every dpivon entry point applies (`dpivon.process`: restarted
on jemalloc, which keeps freed memory for reuse), so the figures are those users get, and no
configuration's timing depends on the others'.

One epoch end to end (``--epoch-dataset``): `dpivon.runs.train` for one epoch,
including the data loading and the validation and test evaluation (BMA for the IVON
family), with the default engine.

    python benchmarks/step_time.py --models tanh-cnn --batch-sizes 256      # CPU, minutes
    python benchmarks/step_time.py --optimizers dp-ivon-gradsq dp-adam --engines bk hooks
    python benchmarks/step_time.py --json results.json --epoch-dataset cifar10  # GPU
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

from dpivon.config import PRIVATE_OPTIMIZERS, TrainConfig, parse_config
from dpivon.data import DataSplits
from dpivon.logs import quiet_known_output
from dpivon.optim.dp_ivon import DPIVON
from dpivon.privacy.engine import plan_privacy
from dpivon.process import configure_process, preload_jemalloc
from dpivon.runs import (
    TrainingSetup,
    build_training,
    load_data,
    resolve_device,
    seed_everything,
    train,
    train_step,
)
from dpivon.runs import setup as run_setup
from dpivon.runs.loop import UPDATE_SHARE_EVERY

BASELINE = "adam"
ENGINES = ("bk", "hooks", "functorch", "ghost")
# The noise calibration depends on (epsilon, delta, C, N, b, epochs) only: the same for all
# configurations of a (model, batch size), so it is computed once for them.
run_setup.plan_privacy = functools.cache(plan_privacy)


@dataclass(frozen=True)
class Row:
    """One measured configuration (the ``--json`` output is a list of these)."""

    measure: str  # "step" or "epoch"
    optimizer: str
    engine: str  # "none" for non-private Adam; the resolved engine for epochs
    model: str
    batch_size: int
    ms_per_step: float
    samples_per_s: float
    peak_mem_mb: float | None
    ratio_to_adam: float
    ratio_to_dp_adam: float | None
    mem_ratio_to_adam: float | None
    epoch_s: float | None
    device: str
    threads: int


# --- one step ---------------------------------------------------------------------------


@dataclass
class Run:
    config: TrainConfig
    setup: TrainingSetup
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    device: torch.device
    steps: int = 0


def build_run(
    optimizer: str, engine: str, model: str, batch_size: int, data, device, research_mode=False
) -> Run:
    fields = {
        "dataset": "synthetic",
        "model": model,
        "optimizer": optimizer,
        "batch_size": batch_size,
        "epochs": 1,
        "device": str(device),
    }
    if optimizer in PRIVATE_OPTIMIZERS:
        fields.update(engine=engine, research_mode=research_mode)
    config = parse_config(fields)
    seed_everything(0)
    setup = build_training(config, data, device)
    # Pass after pass over the (small) training set: Poisson batches of expected size b.
    batches = itertools.chain.from_iterable(itertools.repeat(setup.loader))
    return Run(config, setup, batches, device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def round_robin_times(runs: dict[Any, Run], warmup: int, steps: int) -> dict[Any, list[float]]:
    """Milliseconds of each timed step of each run, the runs stepped in turn so that a change
    of the machine's load reaches all of them alike; each round in a fresh order (a seeded
    shuffle) so that no run always follows the same one and inherits its cache state."""
    for run in runs.values():
        for _ in range(warmup):
            timed_step(run)
    order = random.Random(0)
    keys = list(runs)
    times: dict[Any, list[float]] = {key: [] for key in runs}
    for _ in range(steps):
        order.shuffle(keys)
        for key in keys:
            times[key].append(timed_step(runs[key]))
    return times


def round_robin_medians(runs: dict[Any, Run], warmup: int, steps: int) -> dict[Any, float]:
    """Median ms per step of each run, timed by `round_robin_times`."""
    times = round_robin_times(runs, warmup, steps)
    return {key: statistics.median(t) for key, t in times.items()}


def timed_step(run: Run) -> float:
    """Milliseconds of one train_step (batch drawn before the clock starts).

    Afterwards the gradients are released: a per-sample engine would otherwise hold its
    per-sample gradients until its next step, and all configurations share the memory.
    """
    x, y = next(run.batches)
    if isinstance(run.setup.ivon, DPIVON):  # its diagnostics as often as training logs them
        run.setup.ivon.track_update_share = run.steps % UPDATE_SHARE_EVERY == 0
    run.steps += 1
    synchronize(run.device)
    start = time.perf_counter()
    train_step(run.setup, x, y, run.config.optimizer.samples_per_step)
    synchronize(run.device)
    elapsed = (time.perf_counter() - start) * 1000
    run.setup.optimizer.zero_grad()
    return elapsed


def step_peak_memory_mb(run: Run) -> float:
    """Most tensor memory one step holds at once beyond what was allocated before it."""
    if run.device.type == "cuda":
        synchronize(run.device)
        before = torch.cuda.memory_allocated(run.device)
        torch.cuda.reset_peak_memory_stats(run.device)
        timed_step(run)
        return (torch.cuda.max_memory_allocated(run.device) - before) / 2**20
    # Every allocation and free of torch's CPU allocator, in time order.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        timed_step(run)
    changes = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in changes:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20


# --- one (model, batch size): all configurations round-robin ------------------------------


def synthetic_data(batch_size: int) -> DataSplits:
    """A training set of 4 b examples: Poisson batches of expected size b (q = 1/4), and
    non-private batches of exactly b."""
    fields = {"dataset": "synthetic", "synthetic_size": 4 * batch_size + 10, "val_size": 10}
    return load_data(parse_config(fields))


def measure_steps(args: argparse.Namespace, model: str, batch_size: int, device) -> list[Row]:
    data = synthetic_data(batch_size)
    configs = [(BASELINE, "none")] + [
        (opt, engine) for opt in args.optimizers for engine in args.engines
    ]
    runs = {key: build_run(*key, model, batch_size, data, device) for key in configs}
    ms = round_robin_medians(runs, args.warmup, args.steps)
    memory = {key: step_peak_memory_mb(run) for key, run in runs.items()}
    base = (BASELINE, "none")
    rows = []
    for (optimizer, engine), value in ms.items():
        dp_adam = ms.get(("dp-adam", engine))
        rows.append(
            Row(
                measure="step",
                optimizer=optimizer,
                engine=engine,
                model=model,
                batch_size=batch_size,
                ms_per_step=value,
                samples_per_s=batch_size * 1000 / value,
                peak_mem_mb=memory[(optimizer, engine)],
                ratio_to_adam=value / ms[base],
                ratio_to_dp_adam=value / dp_adam if dp_adam else None,
                mem_ratio_to_adam=memory[(optimizer, engine)] / memory[base],
                epoch_s=None,
                device=device.type,
                threads=torch.get_num_threads(),
            )
        )
    return rows


# --- one epoch end to end -----------------------------------------------------------------


def measure_epochs(args: argparse.Namespace, model: str, device) -> list[Row]:
    """Wall time of load_data + one epoch of train (with evaluation), per optimizer."""
    results = {}
    for optimizer in (BASELINE, *args.epoch_optimizers):
        fields = {
            "dataset": args.epoch_dataset,
            "data_path": args.data_path,
            "model": model,
            "optimizer": optimizer,
            "batch_size": args.epoch_batch_size,
            "epochs": 1,
            "device": str(device),
        }
        if args.epoch_dataset == "synthetic":
            fields["synthetic_size"] = args.epoch_size or 2000
        elif args.epoch_size:
            fields["per_class"] = args.epoch_size // 10
        config = parse_config(fields)
        start = time.perf_counter()
        result = train(config, data=load_data(config))
        results[optimizer] = (time.perf_counter() - start, result)
    base_s = results[BASELINE][0]
    return [
        Row(
            measure="epoch",
            optimizer=optimizer,
            engine=result.engine or "none",
            model=model,
            batch_size=args.epoch_batch_size,
            ms_per_step=seconds * 1000 / result.steps,
            samples_per_s=args.epoch_batch_size * result.steps / seconds,
            peak_mem_mb=None,
            ratio_to_adam=seconds / base_s,
            ratio_to_dp_adam=None,
            mem_ratio_to_adam=None,
            epoch_s=seconds,
            device=device.type,
            threads=torch.get_num_threads(),
        )
        for optimizer, (seconds, result) in results.items()
    ]


# --- report -------------------------------------------------------------------------------


def print_step_tables(steps: list[Row], console: Console) -> None:
    for model, batch_size in dict.fromkeys((r.model, r.batch_size) for r in steps):
        table = Table(
            title=f"{model}, batch {batch_size}, {steps[0].device}, {steps[0].threads} threads"
        )
        columns = ("optimizer", "engine", "ms/step", "samples/s", "x adam", "x dp-adam")
        for column in (*columns, "peak MB", "mem x adam"):
            table.add_column(column, justify="left" if column in columns[:2] else "right")
        for r in steps:
            if (r.model, r.batch_size) != (model, batch_size):
                continue
            table.add_row(
                r.optimizer,
                r.engine,
                f"{r.ms_per_step:.1f}",
                f"{r.samples_per_s:.0f}",
                f"{r.ratio_to_adam:.2f}",
                "-" if r.ratio_to_dp_adam is None else f"{r.ratio_to_dp_adam:.3f}",
                f"{r.peak_mem_mb:.0f}",
                f"{r.mem_ratio_to_adam:.2f}",
            )
        console.print(table)


def print_epoch_table(epochs: list[Row], console: Console) -> None:
    table = Table(title="one epoch end to end (data, training, validation and test)")
    for column in ("model", "optimizer", "engine", "batch", "epoch s", "x adam"):
        table.add_column(column, justify="right" if column in ("epoch s", "x adam") else "left")
    for r in epochs:
        table.add_row(
            r.model,
            r.optimizer,
            r.engine,
            str(r.batch_size),
            f"{r.epoch_s:.1f}",
            f"{r.ratio_to_adam:.2f}",
        )
    console.print(table)


def main() -> None:
    preload_jemalloc()  # restarts the script on jemalloc, as the `dpivon` command starts
    quiet_known_output()
    configure_process()  # what `dpivon train`, sweep trials and benchmark runs apply
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tanh-cnn", "wrn-16-4"])
    parser.add_argument(
        "--batch-sizes", nargs="*", type=int, default=[256, 1024], help="none: epochs only"
    )
    parser.add_argument("--optimizers", nargs="+", default=list(PRIVATE_OPTIMIZERS))
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), help="ew also works")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--epoch-dataset", choices=["synthetic", "cifar10"], help="time an epoch")
    parser.add_argument(
        "--epoch-size", type=int, default=0, help="training images (0: all; synthetic 2000)"
    )
    parser.add_argument("--epoch-batch-size", type=int, default=256)
    parser.add_argument("--epoch-optimizers", nargs="+", default=["dp-ivon-gradsq", "dp-adam"])
    parser.add_argument("--data-path", default=None, help="CIFAR-10 (else $DPIVON_DATA)")
    args = parser.parse_args()
    device = resolve_device(args.device)
    console = Console(width=120)

    rows: list[Row] = []
    for model in args.models:
        for batch_size in args.batch_sizes:
            group = measure_steps(args, model, batch_size, device)
            print_step_tables(group, console)
            rows += group
    if args.epoch_dataset:
        epochs = [row for model in args.models for row in measure_epochs(args, model, device)]
        print_epoch_table(epochs, console)
        rows += epochs
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
