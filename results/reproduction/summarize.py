"""Write results/reproduction.json from the finished seeds of the reproduction.

Each seed's run writes ``results/reproduction/dp-sgd-eps3-seed<N>.json`` (`dpivon train
--json`, see README.md here); this reads every one of them, checks that they ran the
anchor's setting (optimizer, epsilon, delta, epochs, batch size, clip norm), and writes the
machine-readable summary beside Tramer & Boneh's published 59.2%:

    .venv/bin/python results/reproduction/summarize.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "reproduction.json"
PUBLISHED_ACCURACY = 0.592  # Tramer & Boneh (ICLR 2021), end-to-end CNN, (3, 1e-5)-DP
SETTING = {  # what every seed must have run: their setting (config.yaml here)
    "optimizer": "dp-sgd",
    "model": "tramer-boneh-cnn",
    "target_epsilon": 3.0,
    "delta": 1e-5,
    "epochs": 30,
    "batch_size": 1024,
    "max_grad_norm": 0.1,
}


def seed_runs() -> dict[int, dict]:
    runs = {}
    for path in sorted(HERE.glob("dp-sgd-eps3-seed*.json")):
        run = json.loads(path.read_text())
        wrong = {k: run.get(k) for k, v in SETTING.items() if run.get(k) != v}
        if wrong:
            sys.exit(f"{path.name} did not run the anchor's setting: {wrong}")
        runs[int(path.stem.removeprefix("dp-sgd-eps3-seed"))] = run
    if not runs:
        sys.exit(f"no finished seed in {HERE} (dp-sgd-eps3-seed<N>.json)")
    return runs


def summary(runs: dict[int, dict]) -> dict:
    accuracies = [run["test_accuracy"] for run in runs.values()]
    first = next(iter(runs.values()))
    # N from what the accountant used: q = b / N
    train_images = round(first["batch_size"] / first["sample_rate"])
    mean = statistics.fmean(accuracies)
    return {
        "published_accuracy": PUBLISHED_ACCURACY,
        "accuracy": mean,
        "accuracy_std": statistics.stdev(accuracies) if len(accuracies) > 1 else None,
        "accuracy_per_seed": dict(zip(map(str, runs), accuracies, strict=True)),
        "gap_points": round(100 * (mean - PUBLISHED_ACCURACY), 2),
        "epsilon": max(run["epsilon_spent"] for run in runs.values()),
        "target_epsilon": first["target_epsilon"],
        "delta": first["delta"],
        "accountant": first["accountant"],
        "noise_multiplier": first["noise_multiplier"],
        "epochs": first["epochs"],
        "steps": first["steps"],
        "batch_size": first["batch_size"],
        "max_grad_norm": first["max_grad_norm"],
        "train_images": train_images,
        "seeds": sorted(runs),
        "test_nll": statistics.fmean(run["test_nll"] for run in runs.values()),
        "test_ece": statistics.fmean(run["test_ece"] for run in runs.values()),
    }


def main() -> None:
    record = summary(seed_runs())
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"wrote {OUT}: accuracy {record['accuracy']:.4f} over seeds {record['seeds']} "
        f"(published {PUBLISHED_ACCURACY}; {record['gap_points']:+.2f} points)"
    )


if __name__ == "__main__":
    main()
