"""The `dpivon` command line: train one run, sweep, inspect the Pareto front, export."""

from __future__ import annotations

import functools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from dpivon.config import OPTIMIZER_NAMES, load_config, parse_config
from dpivon.errors import DpivonError

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Private, uncertainty-aware training (DP-IVON-Gradsq and baselines) and sweeps.",
)
console = Console(stderr=True)


def user_errors(command: Callable) -> Callable:
    """Bad input becomes one red line and exit code 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except DpivonError as err:
            console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def _given(**flags: Any) -> dict[str, Any]:
    return {k: v for k, v in flags.items() if v is not None}


Opt = Annotated


@app.callback()
def root() -> None:
    """dpivon: DP-IVON-Gradsq sweeps and benchmarks (see README.md)."""


@app.command()
@user_errors
def train(
    config: Opt[
        Path | None, typer.Option(help="YAML training config (e.g. from dpivon export)")
    ] = None,
    dataset: Opt[str | None, typer.Option(help="cifar10 or synthetic")] = None,
    data_path: Opt[
        str | None, typer.Option(help="CIFAR-10 tarball/folder (else $DPIVON_DATA)")
    ] = None,
    model: Opt[str | None, typer.Option(help="small-cnn, tanh-cnn or wrn-16-4")] = None,
    optimizer: Opt[str | None, typer.Option(help=", ".join(OPTIMIZER_NAMES))] = None,
    epsilon: Opt[float | None, typer.Option(help="target epsilon (inf: no noise)")] = None,
    delta: Opt[float | None, typer.Option()] = None,
    accountant: Opt[str | None, typer.Option(help="rdp or prv")] = None,
    max_grad_norm: Opt[float | None, typer.Option(help="per-example clip norm C")] = None,
    epochs: Opt[int | None, typer.Option()] = None,
    batch_size: Opt[int | None, typer.Option(help="expected batch size b (Poisson)")] = None,
    lr: Opt[float | None, typer.Option()] = None,
    lr_schedule: Opt[str | None, typer.Option(help="constant or cosine")] = None,
    hess_init: Opt[float | None, typer.Option()] = None,
    beta2: Opt[float | None, typer.Option()] = None,
    weight_decay: Opt[float | None, typer.Option()] = None,
    mc_samples: Opt[int | None, typer.Option()] = None,
    per_class: Opt[int | None, typer.Option(help="training images per class (subset)")] = None,
    val_size: Opt[int | None, typer.Option()] = None,
    bma_samples: Opt[int | None, typer.Option(help="posterior samples for BMA (IVON)")] = None,
    seed: Opt[int | None, typer.Option()] = None,
    device: Opt[str | None, typer.Option(help="auto, cpu or cuda")] = None,
    json_path: Opt[Path | None, typer.Option("--json", help="write the flat result here")] = None,
    tracking_uri: Opt[
        str | None, typer.Option(help="MLflow URI (default sqlite:///mlflow.db)")
    ] = None,
    experiment: Opt[str, typer.Option(help="MLflow experiment")] = "dpivon",
    log_model: Opt[bool, typer.Option(help="log the model (with posterior) to MLflow")] = True,
) -> None:
    """Train one model at a fixed epsilon and track it in MLflow."""
    from dpivon.tracking import Tracker, log_training_result
    from dpivon.training import load_data
    from dpivon.training import train as run_training

    overrides = _given(
        dataset=dataset,
        data_path=data_path,
        model=model,
        optimizer=optimizer,
        epsilon=epsilon,
        delta=delta,
        accountant=accountant,
        max_grad_norm=max_grad_norm,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        lr_schedule=lr_schedule,
        hess_init=hess_init,
        beta2=beta2,
        weight_decay=weight_decay,
        mc_samples=mc_samples,
        per_class=per_class,
        val_size=val_size,
        bma_samples=bma_samples,
        seed=seed,
        device=device,
    )
    if config is not None:
        cfg = load_config(config, overrides)
    else:
        cfg = parse_config(overrides, source="options")
    if not cfg.is_private and epsilon is not None and not math.isinf(epsilon):
        console.print(f"[yellow]note:[/] {cfg.optimizer} is not private: --epsilon is ignored")

    data = load_data(cfg)  # bad data input fails here, before any run is recorded
    tracker = Tracker(tracking_uri, experiment)
    console.print(f"tracking to {tracker.tracking_uri} (experiment {experiment!r})")
    with tracker.run(
        f"{cfg.optimizer}-eps{cfg.epsilon:g}", tags={"dpivon.kind": "train"}
    ) as run_id:
        tracker.log_params(run_id, cfg.model_dump(mode="json"))
        tracker.log_text(run_id, cfg.to_yaml(), "config.yaml")

        def log_epoch(report) -> None:
            tracker.log_metrics(run_id, report.metrics, step=report.epoch)

        result = run_training(cfg, data=data, on_epoch_end=log_epoch, progress=sys.stderr.isatty())
        log_training_result(tracker, run_id, result, with_model=log_model)
    summary = {**result.summary(), "mlflow_run_id": run_id}
    _print_summary(summary)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(summary, indent=2) + "\n")
        console.print(f"wrote {json_path}")


def _print_summary(summary: dict[str, Any]) -> None:
    table = Table(title="result", show_header=False)
    for key in (
        "optimizer",
        "target_epsilon",
        "epsilon_spent",
        "noise_multiplier",
        "steps",
        "val_accuracy",
        "val_ece",
        "test_accuracy",
        "test_nll",
        "test_ece",
        "test_brier",
        "wall_time_s",
        "mlflow_run_id",
    ):
        value = summary.get(key)
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)


def main() -> None:
    app()
