"""Cost of a whole trial as users run it: `dpivon train` for adam, dp-adam and dp-ivon-gradsq.

Each run is a fresh `python -m dpivon.cli train ... --profile --json` process (the real
entry point: its process settings, data loading from the CIFAR-10 cache, MLflow tracking to
a throw-away SQLite store, the default evaluation settings unless flags change them).
The optimizers run interleaved, one run of each per round, the order rotated every round,
so drift in machine load hits them alike. Per optimizer and phase the table shows the
median over rounds and its ratio to dp-adam's; ``startup`` is the process's wall time
minus the phases `--profile` reports (interpreter, imports, MLflow run creation), ``total``
the process's wall time. The load average is printed before and after: on a shared
machine absolute times are inflated, and only the interleaved ratios compare.

    # the quickstart subset: tanh-cnn, 4,000 training images, 2 epochs (CPU: minutes)
    python benchmarks/trial_time.py --per-class 400 --epochs 2 --repeats 2
    # full CIFAR-10 (45,000 training images), 1 epoch
    python benchmarks/trial_time.py --per-class 0 --epochs 1 --repeats 1 --json full.json

``--json`` writes rows ``optimizer, phase, seconds, ratio_to_dp_adam``. Arguments after
``--`` go to every `dpivon train` (e.g. ``-- --val-bma-samples 16``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dpivon.optim.registry import PRIVATE_OPTIMIZERS
from dpivon.runs import PHASES

OPTIMIZERS = ("adam", "dp-adam", "dp-ivon-gradsq")
BASELINE = "dp-adam"
ROWS = ("startup", *PHASES, "total")


def train_command(args: argparse.Namespace, optimizer: str, out: Path, workdir: Path) -> list:
    command = [
        sys.executable, "-m", "dpivon.cli", "train",
        "--dataset", "cifar10", "--model", args.model, "--optimizer", optimizer,
        "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
        "--device", args.device,
        "--tracking-uri", f"sqlite:///{workdir / 'mlflow.db'}", "--experiment", "trial-time",
        "--json", str(out), "--profile",
    ]  # fmt: skip
    if optimizer in PRIVATE_OPTIMIZERS:  # a non-private run takes no epsilon (it is inf)
        command += ["--epsilon", str(args.epsilon)]
    if args.per_class:
        command += ["--per-class", str(args.per_class)]
    if args.data_path:
        command += ["--data-path", args.data_path]
    if not args.log_model:
        command.append("--no-log-model")
    return command + args.train_args


def run_once(command: list, out: Path) -> dict[str, float]:
    """Seconds per row of ``ROWS`` for one `dpivon train` process."""
    start = time.perf_counter()
    finished = subprocess.run(command, capture_output=True, text=True)
    total = time.perf_counter() - start
    if finished.returncode != 0:
        tail = "\n".join(finished.stderr.strip().splitlines()[-5:])
        failed = f"dpivon train failed ({finished.returncode}): {' '.join(command)}"
        raise SystemExit(f"{failed}\n{tail}")
    summary = json.loads(out.read_text())
    phases = {phase: summary[f"profile_{phase}_s"] for phase in PHASES}
    return {"startup": total - sum(phases.values()), **phases, "total": total}


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tanh-cnn")
    parser.add_argument("--per-class", type=int, default=400, help="0: every training image")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the optimizers")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--data-path", default=None, help="CIFAR-10 (else $DPIVON_DATA)")
    parser.add_argument("--log-model", action="store_true", help="also log each model")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("train_args", nargs="*", help="after --: more `dpivon train` flags")
    args = parser.parse_args()
    if BASELINE not in args.optimizers:
        parser.error(f"--optimizers must include {BASELINE}, the baseline of the ratios")
    console = Console(width=120)
    console.print(f"load average (1, 5, 15 min) before: {load()} on {os.cpu_count()} CPUs")
    seconds: dict[str, list[dict[str, float]]] = {opt: [] for opt in args.optimizers}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for round_ in range(args.repeats):
            shift = round_ % len(args.optimizers)
            for optimizer in args.optimizers[shift:] + args.optimizers[:shift]:
                out = workdir / f"{optimizer}-{round_}.json"
                command = train_command(args, optimizer, out, workdir)
                seconds[optimizer].append(run_once(command, out))
                console.print(
                    f"round {round_ + 1}/{args.repeats} {optimizer}: "
                    f"{seconds[optimizer][-1]['total']:.1f} s (load {load()})"
                )
    median = {
        opt: {row: statistics.median(run[row] for run in runs) for row in ROWS}
        for opt, runs in seconds.items()
    }
    scale = "all training images" if not args.per_class else f"{args.per_class * 10} images"
    table = Table(
        title=f"one `dpivon train` trial: {args.model}, {scale}, {args.epochs} epoch(s), "
        f"batch {args.batch_size}, median of {args.repeats} interleaved round(s)"
    )
    table.add_column("phase")
    for opt in args.optimizers:
        table.add_column(f"{opt} s", justify="right")
        table.add_column(f"x {BASELINE}", justify="right")
    rows = []
    for row in ROWS:
        cells = [row]
        for opt in args.optimizers:
            value, base = median[opt][row], median[BASELINE][row]
            ratio = value / base if base > 0 else None
            cells += [f"{value:.1f}", "-" if ratio is None else f"{ratio:.2f}"]
            rows.append(
                {"optimizer": opt, "phase": row, "seconds": value, "ratio_to_dp_adam": ratio}
            )
        table.add_row(*cells)
    console.print(table)
    console.print(f"load average after: {load()}; command of one run: {' '.join(command)}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
