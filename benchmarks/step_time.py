"""Milliseconds per training step of every optimizer, as ratios to non-private Adam.

All optimizers run in this one process on the same model, batch size and data, through the
same `build_training` / `train_step` the real training loop uses (Opacus hooks, Poisson
sampling, IVON posterior sampling). Target: dp-ivon-gradsq <= 1.10x dp-adam.

    python benchmarks/step_time.py            # tanh-cnn, batch 256, 3 warm-up + 10 rounds
    python benchmarks/step_time.py --model small-cnn --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from dpivon.config import OPTIMIZER_NAMES, parse_config
from dpivon.training import build_training, load_data, resolve_device, seed_everything, train_step


def build(name: str, args: argparse.Namespace, data):
    config = parse_config({
        "dataset": "synthetic", "synthetic_size": args.train_size, "model": args.model,
        "optimizer": name, "batch_size": args.batch_size, "epochs": 1, "device": args.device,
    })
    seed_everything(0)
    setup = build_training(config, data, resolve_device(config.device))
    return config, setup, iter(setup.loader)


def timed_step(config, setup, batches) -> float:
    device = resolve_device(config.device)
    x, y = next(batches)
    x, y = x.to(device), y.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    train_step(setup, x, y, config.mc_samples)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tanh-cnn")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--optimizers", nargs="*", default=list(OPTIMIZER_NAMES))
    args = parser.parse_args()
    # Enough examples that Poisson sampling at the given batch size never runs out of steps.
    args.train_size = args.batch_size * (args.warmup + args.steps + 2) * 10 // 9 + 100
    # (one Poisson pass over that many examples has more than warmup + steps batches)
    data = load_data(parse_config({"dataset": "synthetic", "synthetic_size": args.train_size}))

    names = ["adam"] + [n for n in args.optimizers if n != "adam"]
    runs = {name: build(name, args, data) for name in names}
    for run in runs.values():
        for _ in range(args.warmup):
            timed_step(*run)
    # Round-robin, one step of each optimizer per round: drift in machine load (other
    # processes, frequency scaling) hits every optimizer alike instead of the last ones.
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.steps):
        for name, run in runs.items():
            times[name].append(timed_step(*run))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, ms in medians.items():
        print(f"{name:28s} {ms:9.1f} ms/step (min {min(times[name]):.1f})", flush=True)

    table = Table(title=f"{args.model}, batch {args.batch_size}, {torch.get_num_threads()} "
                  f"threads, median of {args.steps} steps")
    for column in ("optimizer", "ms/step", "x adam", "x dp-adam"):
        table.add_column(column, justify="right" if column != "optimizer" else "left")
    for name, ms in medians.items():
        vs_dp_adam = f"{ms / medians['dp-adam']:.2f}" if "dp-adam" in medians else "-"
        table.add_row(name, f"{ms:.1f}", f"{ms / medians['adam']:.2f}", vs_dp_adam)
    Console().print(table)
    if "dp-adam" in medians and "dp-ivon-gradsq" in medians:
        ratio = medians["dp-ivon-gradsq"] / medians["dp-adam"]
        verdict = "meets" if ratio <= 1.10 else "MISSES"
        print(f"dp-ivon-gradsq / dp-adam = {ratio:.3f} ({verdict} the 1.10x target)")


if __name__ == "__main__":
    main()
