"""How soon `dpivon` answers: the seconds from process start to the error line of three
mistakes (a missing data path, a config file's unknown key, epsilon 0), and to the end of
`dpivon --help` (issue 47: a refusal within 2 s, the help within 1 s, on an idle machine).

Each case runs the installed `dpivon` command (its jemalloc restart included, as users run
it) in a fresh empty folder, round-robin with the others in a shuffled order per round; the
clock stops when the line starting ``error:`` reaches stderr (for --help: at exit). Two
baselines run in the same rounds, under the same load: the interpreter's start (the floor)
and the import of torch, Ray, MLflow, Optuna and Opacus (what every command loaded before
its first check); the ratios divide each case's median by theirs. The load average before
and after is printed: on a busy machine every figure grows, the ratios much less.

    python benchmarks/refusal_latency.py                 # 5 rounds: about a minute
    python benchmarks/refusal_latency.py --rounds 11 --json latency.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

DPIVON = str(Path(sys.executable).with_name("dpivon"))
HEAVY_IMPORTS = "import torch, ray, mlflow, optuna, opacus"
# name -> (command, the exit code it must end with); {typo} is a config with an unknown key
CASES = {
    "dpivon --help": ([DPIVON, "--help"], 0),
    "missing data path": (
        [DPIVON, "train", "--dataset=cifar10", "--optimizer=dp-sgd",
         "--data-path=/nonexistent.tar.gz"],
        2,
    ),
    "config typo": ([DPIVON, "train", "--config={typo}"], 2),
    "epsilon 0": ([DPIVON, "train", "--dataset=synthetic", "--optimizer=dp-sgd", "--epsilon=0"], 2),
}  # fmt: skip
BASELINES = {
    "python start": ([sys.executable, "-c", "pass"], 0),
    "heavy imports": ([sys.executable, "-c", HEAVY_IMPORTS], 0),
}
TARGETS_S = {"dpivon --help": 1.0, "missing data path": 2.0, "config typo": 2.0, "epsilon 0": 2.0}


def seconds_to_answer(command: list[str], code: int, folder: Path) -> float:
    """Seconds from the start of ``command`` (run in ``folder``) to its first ``error:``
    line on stderr, or to its exit where it should succeed; a wrong exit code or no error
    line is an error: the figure would time something else."""
    env = {k: v for k, v in os.environ.items() if k != "DPIVON_DATA"}
    start = time.perf_counter()
    with subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as process:  # fmt: skip
        answered = None
        for line in process.stderr:
            if answered is None and line.startswith("error:"):
                answered = time.perf_counter() - start
        returned = process.wait()
    ended = time.perf_counter() - start
    if returned != code or (code != 0 and answered is None):
        raise SystemExit(f"{' '.join(command)} exited {returned} (expected {code}) "
                         f"{'with' if answered else 'without'} an error line")  # fmt: skip
    return answered if answered is not None else ended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="of the order within rounds")
    parser.add_argument("--json", type=Path, help="write the medians and the load here")
    args = parser.parse_args()
    console = Console(width=120)
    load_before = os.getloadavg()
    console.print(f"{os.cpu_count()} CPUs, load average before: {load_before}")
    order = random.Random(args.seed)
    times: dict[str, list[float]] = {name: [] for name in [*CASES, *BASELINES]}
    with tempfile.TemporaryDirectory() as tmp:
        typo = Path(tmp) / "typo.yaml"
        typo.write_text("optimizer: dp-sgd\nlearnig_rate: 0.1\n")
        runs = {**CASES, **BASELINES}
        for _ in range(args.rounds):
            for name in order.sample(list(runs), len(runs)):
                command, code = runs[name]
                folder = Path(tempfile.mkdtemp(dir=tmp))  # anything a case writes: apart
                command = [part.format(typo=typo) for part in command]
                times[name].append(seconds_to_answer(command, code, folder))
                if any(folder.iterdir()):
                    raise SystemExit(f"{name} left files behind: {sorted(folder.iterdir())}")
    load_after = os.getloadavg()
    median = {name: statistics.median(values) for name, values in times.items()}
    table = Table(title=f"seconds to the answer, median of {args.rounds} rounds")
    for column in ("case", "median s", "min s", "x python start", "/ heavy imports", "target"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for name, values in times.items():
        target = TARGETS_S.get(name)
        met = (
            ""
            if target is None
            else f"{target:g} s " + ("ok" if median[name] <= target else "over")
        )
        table.add_row(
            name,
            f"{median[name]:.2f}",
            f"{min(values):.2f}",
            f"{median[name] / median['python start']:.1f}",
            f"{median[name] / median['heavy imports']:.2f}",
            met,
        )
    console.print(table)
    console.print(f"load average after: {load_after} (targets hold for an idle machine)")
    if args.json is not None:
        payload = {
            "median_s": median,
            "times_s": times,
            "rounds": args.rounds,
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": load_after,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
