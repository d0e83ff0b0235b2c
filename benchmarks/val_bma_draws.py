"""How many posterior draws the per-epoch validation needs: BMA accuracy and ECE with 1, 2,
4 and 8 draws against 16, at every epoch of a real DP-IVON-Gradsq run.

The run is `dpivon.runs.train` on CIFAR-10 (default: the quickstart subset, tanh-cnn,
4,000 training images, 5,000 validation images, batch 256, epsilon 8). After each epoch the
validation set is evaluated with one sequence of 16 draws from the epoch's posterior,
seeded as `dpivon.evaluation.evaluate` seeds it, so the k-draw figures are exactly what
``val_bma_samples: k`` reports (its first k draws). ``mean`` is the prediction at the
posterior mean.

    python benchmarks/val_bma_draws.py --epochs 3            # CPU: minutes
    python benchmarks/val_bma_draws.py --per-class 0 --epochs 2 --json draws.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dpivon.config import parse_assignments, parse_config
from dpivon.evaluation import Posterior, posterior_draws, predict_probs
from dpivon.evaluation.metrics import classification_metrics
from dpivon.logs import quiet_known_output
from dpivon.models import build_model
from dpivon.process import configure_process, preload_jemalloc
from dpivon.runs import EpochReport, load_data, train

DRAWS = (1, 2, 4, 8, 16)


def epoch_posterior(model_name: str, checkpoint: dict) -> tuple[torch.nn.Module, Posterior]:
    """The mean network and the posterior of an epoch's checkpoint."""
    model = build_model(model_name)
    model.load_state_dict(checkpoint["model"])
    optimizer = checkpoint["optimizer"]
    (group,) = optimizer["param_groups"]
    hess = {
        name: optimizer["state"][index]["hess"]
        for name, index in zip(dict(model.named_parameters()), group["params"], strict=True)
    }
    return model, Posterior(hess, float(group["ess"]), float(group["weight_decay"]))


def draw_metrics(model, posterior, dataset, seed: int, n_bins: int) -> dict[str, dict]:
    """Metrics of the mean prediction and of BMA over the first k of 16 draws."""
    images, labels = dataset.tensors
    out = {"mean": classification_metrics(predict_probs(model, images), labels, n_bins)}
    generator = torch.Generator().manual_seed(seed)
    total = None
    with posterior_draws(model, posterior, generator) as draw:
        for k in range(1, max(DRAWS) + 1):
            draw()
            probs = predict_probs(model, images)
            total = probs if total is None else total.add_(probs)
            if k in DRAWS:
                out[str(k)] = classification_metrics(total / k, labels, n_bins)
    return out


def main() -> None:
    preload_jemalloc()  # restarts the script on jemalloc, as the `dpivon` command starts
    quiet_known_output()
    configure_process()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tanh-cnn")
    parser.add_argument("--per-class", type=int, default=400, help="0: every training image")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], help="config PATH=VALUE (YAML)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    fields = {
        "dataset": "cifar10",
        "model": args.model,
        "optimizer": "dp-ivon-gradsq",
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "epsilon": args.epsilon,
        "seed": args.seed,
        "val_bma_samples": 0,  # the draws are evaluated here
        **({"per_class": args.per_class} if args.per_class else {}),
        **parse_assignments(args.set),
    }
    config = parse_config(fields)
    data = load_data(config)
    console = Console(width=120)
    rows = []

    def on_epoch_end(report: EpochReport) -> None:
        model, posterior = epoch_posterior(config.model.name, report.checkpoint())
        metrics = draw_metrics(
            model, posterior, data.val, config.runtime.seed, config.evaluation.ece_bins
        )
        reference = metrics[str(max(DRAWS))]
        for draws, values in metrics.items():
            rows.append(
                {
                    "epoch": report.epoch,
                    "draws": draws,
                    "accuracy": values["accuracy"],
                    "ece": values["ece"],
                    "nll": values["nll"],
                    "ece_minus_16": values["ece"] - reference["ece"],
                    "accuracy_minus_16": values["accuracy"] - reference["accuracy"],
                }
            )
        shown = (f"{k}: acc {v['accuracy']:.4f} ece {v['ece']:.4f}" for k, v in metrics.items())
        console.print(f"epoch {report.epoch}: " + ", ".join(shown), highlight=False)

    train(config, data=data, on_epoch_end=on_epoch_end, evaluate_test=False)
    sizes = f"{len(data.train)} training / {len(data.val)} validation images"
    table = Table(
        title=f"validation BMA vs draws: {config.model.name}, {sizes}, epsilon {args.epsilon:g}"
    )
    for column in ("epoch", "draws", "accuracy", "ECE", "NLL", "ECE - ECE16", "acc - acc16"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            str(r["epoch"]), r["draws"], f"{r['accuracy']:.4f}", f"{r['ece']:.4f}",
            f"{r['nll']:.4f}", f"{r['ece_minus_16']:+.4f}", f"{r['accuracy_minus_16']:+.4f}",
        )  # fmt: skip
    console.print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
