"""Milliseconds per training step of every optimizer, as ratios to non-private Adam.

All optimizers run in this one process on the same model, batch size and data, through the
same `build_training` / `train_step` the real training loop uses (Opacus hooks, Poisson
sampling, IVON posterior sampling). Target: dp-ivon-gradsq <= 1.10x dp-adam.

    python benchmarks/step_time.py            # tanh-cnn, batch 256, 3 warm-up + 10 steps
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


def time_optimizer(name: str, args: argparse.Namespace, data) -> list[float]:
    config = parse_config({
        "dataset": "synthetic", "synthetic_size": args.train_size, "model": args.model,
        "optimizer": name, "batch_size": args.batch_size, "epochs": 1, "device": args.device,
    })
    seed_everything(0)
    device = resolve_device(config.device)
    setup = build_training(config, data, device)
    batches = iter(setup.loader)
    times = []
    for i in range(args.warmup + args.steps):
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(setup, x, y, config.mc_samples)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1000)
    return times


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
    data = load_data(parse_config({"dataset": "synthetic", "synthetic_size": args.train_size}))

    names = ["adam"] + [n for n in args.optimizers if n != "adam"]
    medians = {}
    for name in names:
        times = time_optimizer(name, args, data)
        medians[name] = statistics.median(times)
        print(f"{name:28s} {medians[name]:9.1f} ms/step (min {min(times):.1f})", flush=True)

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
