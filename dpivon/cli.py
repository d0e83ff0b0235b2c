"""The `dpivon` command line: train one run, sweep, inspect the Pareto front, export."""

from __future__ import annotations

import functools
import json
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from dpivon.config import OPTIMIZER_NAMES, load_configs, parse_config
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


EPOCH_LINE = (
    "train_loss",
    "val_accuracy",
    "val_ece",
    "val_nll",
    "epsilon_spent",
    "projected_fraction",
    "hess_median",
)


def _given(**flags: Any) -> dict[str, Any]:
    return {k: v for k, v in flags.items() if v is not None}


Opt = Annotated


def check_outputs(json_path: Path | None, experiment: str) -> None:
    """Outputs that would fail only after a long run fail now: an unwritable --json path,
    an empty experiment name."""
    if not experiment.strip():
        raise DpivonError("--experiment must not be empty")
    if json_path is None:
        return
    try:
        if json_path.is_dir():
            raise IsADirectoryError(f"{json_path} is a folder")
        json_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=json_path.parent):
            pass
    except OSError as err:
        raise DpivonError(f"cannot write --json {json_path}: {err}") from None


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
    engine: Opt[
        str | None, typer.Option(help="auto, bk, hooks, functorch, ew or ghost (clipping)")
    ] = None,
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
    secure_mode: Opt[
        bool | None,
        typer.Option(
            help="DP noise and sampling from OS entropy (never stored), floating-point "
            "attack defence; off: reproducible by seed"
        ),
    ] = None,
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
        engine=engine,
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
        secure_mode=secure_mode,
        device=device,
    )
    configs = (
        load_configs(config, overrides)
        if config is not None
        else [parse_config(overrides, source="options")]
    )
    for cfg in configs:
        if not cfg.is_private and epsilon is not None and not math.isinf(epsilon):
            console.print(f"[yellow]note:[/] {cfg.optimizer} is not private: --epsilon is ignored")
    check_outputs(json_path, experiment)
    datasets = [load_data(cfg) for cfg in configs]  # bad data input fails before any run
    tracker = Tracker(tracking_uri, experiment)
    console.print(f"tracking to {tracker.display_uri} (experiment {experiment!r})")
    summaries = []
    for cfg, data in zip(configs, datasets, strict=True):
        name = f"{cfg.optimizer}-eps{cfg.epsilon:g}"
        with tracker.run(name, tags={"dpivon.kind": "train"}) as run_id:
            tracker.log_params(run_id, cfg.model_dump(mode="json"))
            tracker.log_text(run_id, cfg.to_yaml(), "config.yaml")

            def log_epoch(report, run_id=run_id, epochs=cfg.epochs) -> None:
                tracker.log_metrics(run_id, report.metrics, step=report.epoch)
                shown = {k: report.metrics[k] for k in EPOCH_LINE if k in report.metrics}
                console.print(
                    f"epoch {report.epoch}/{epochs} "
                    + " ".join(f"{k}={v:.4g}" for k, v in shown.items()),
                    highlight=False,
                )

            result = run_training(
                cfg, data=data, on_epoch_end=log_epoch, progress=sys.stderr.isatty()
            )
            log_training_result(tracker, run_id, result, with_model=log_model)
        summaries.append({**result.summary(), "mlflow_run_id": run_id})
        _print_summary(summaries[-1])
        if "epsilon_covers" in summaries[-1]:
            console.print(summaries[-1]["epsilon_covers"], highlight=False)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        payload = summaries[0] if len(summaries) == 1 else summaries
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
        console.print(f"wrote {json_path}")


def _print_summary(summary: dict[str, Any]) -> None:
    table = Table(title="result", show_header=False)
    for key in (
        "optimizer",
        "target_epsilon",
        "epsilon_spent",
        "tuning_epsilon",
        "epsilon_with_tuning",
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


@app.command()
@user_errors
def sweep(
    pipeline: Opt[Path, typer.Argument(help="pipeline YAML, e.g. pipelines/quickstart.yaml")],
    resume: Opt[bool, typer.Option(help="continue this pipeline's interrupted sweep")] = False,
    address: Opt[
        str | None, typer.Option(help="Ray cluster address (else $RAY_ADDRESS, else a local Ray)")
    ] = None,
    tracking_uri: Opt[str | None, typer.Option(help="MLflow URI (overrides the pipeline)")] = None,
) -> None:
    """Run a hyper-parameter sweep: Ray Tune trials, Optuna search, MLflow tracking."""
    from dpivon.search.pipeline import load_pipeline
    from dpivon.search.sweep import run_sweep, sweep_directory

    loaded = load_pipeline(pipeline)
    trials = run_sweep(loaded, address=address, tracking_uri=tracking_uri, resume=resume)
    counts = trials["status"].value_counts().to_dict()
    console.print(
        f"sweep {loaded.name!r} finished: {counts}; results in "
        f"{sweep_directory(loaded)}; open the MLflow UI with `make ui`"
    )


@app.command()
@user_errors
def benchmark(
    pipeline: Opt[
        Path, typer.Argument(help="benchmark YAML, e.g. pipelines/benchmark-cifar10-4k.yaml")
    ],
    resume: Opt[bool, typer.Option(help="skip runs MLflow records as completed")] = False,
    address: Opt[
        str | None, typer.Option(help="Ray cluster address (else $RAY_ADDRESS, else a local Ray)")
    ] = None,
    tracking_uri: Opt[str | None, typer.Option(help="MLflow URI (overrides the pipeline)")] = None,
) -> None:
    """Train every method x epsilon x seed on Ray, aggregate over seeds, write the report.
    Exit 1 when some run failed (the report covers the others; --resume reruns them)."""
    from dpivon.study.benchmark import run_benchmark
    from dpivon.study.report import results_rows
    from dpivon.study.spec import load_benchmark

    loaded = load_benchmark(pipeline)
    outcome = run_benchmark(loaded, address=address, tracking_uri=tracking_uri, resume=resume)
    header, rows = results_rows(outcome.report.table)
    table = Table(title=f"benchmark {loaded.name}: mean ± std over seeds")
    for column in header:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=200).print(table)
    for line in outcome.report.verdict:
        Console(width=200).print(line, highlight=False)
    console.print(
        f"benchmark {loaded.name!r}: {len(outcome.completed)} runs done now, "
        f"{outcome.skipped} before, {len(outcome.failed)} failed; report: "
        + ", ".join(str(p) for p in outcome.report_files[:2]),
        highlight=False,
    )
    if outcome.failed:
        console.print(
            f"[bold red]{len(outcome.failed)} run(s) failed[/]; see the report, then "
            f"`dpivon benchmark {pipeline} --resume`",
            highlight=False,
        )
        raise typer.Exit(1)


@app.command()
@user_errors
def pareto(
    sweep_ref: Opt[
        str, typer.Argument(metavar="SWEEP", help="sweep folder, pipeline file or name")
    ],
    out: Opt[
        Path | None, typer.Option(help="plot path (.png; an .html is written beside it)")
    ] = None,
) -> None:
    """Print a finished sweep's Pareto fronts (validation; test for members) and plot them."""
    from dpivon.search.export import load_results, resolve_sweep
    from dpivon.search.pareto import plot_fronts_html, plot_fronts_png, print_front_table
    from dpivon.search.sweep import SweepState

    directory = resolve_sweep(sweep_ref)
    state = SweepState.load(directory)
    trials, front = load_results(directory)
    extra = [
        c
        for c in (
            "test_accuracy",
            "test_ece",
            "param.lr",
            "param.batch_size",
            "param.max_grad_norm",
            "param.hess_init",
        )
        if c in front
    ]
    print_front_table(front, state.objectives, extra)
    out = out or directory / "pareto.png"
    plot_fronts_png(trials, state.objectives, out, f"{state.name}: Pareto fronts")
    plot_fronts_html(
        trials, state.objectives, out.with_suffix(".html"), f"{state.name}: Pareto fronts"
    )
    console.print(f"wrote {out} and {out.with_suffix('.html')}")


@app.command()
@user_errors
def export(
    sweep_ref: Opt[
        str, typer.Argument(metavar="SWEEP", help="sweep folder, pipeline file or name")
    ],
    out: Opt[Path, typer.Option(help="YAML file for `dpivon train --config`")],
    pick: Opt[str, typer.Option(help="knee, max-accuracy, min-ece or pareto")] = "knee",
    optimizer: Opt[str | None, typer.Option(help="only this optimizer's front")] = None,
    epsilon: Opt[float | None, typer.Option(help="only this epsilon's front")] = None,
    epochs: Opt[int | None, typer.Option(help="production epochs (default: the sweep's)")] = None,
    full_data: Opt[bool, typer.Option(help="train on the full training set")] = True,
    secure_mode: Opt[
        bool,
        typer.Option(help="noise from OS entropy, never stored (off: reproducible by seed)"),
    ] = True,
) -> None:
    """Write the chosen Pareto-optimal configurations as production training configs."""
    from dpivon.search.export import export_configs, resolve_sweep, write_configs
    from dpivon.search.sweep import SweepState

    directory = resolve_sweep(sweep_ref)
    objectives = SweepState.load(directory).objectives
    picked = export_configs(
        directory,
        objectives,
        pick,
        optimizer=optimizer,
        epsilon=epsilon,
        epochs=epochs,
        full_data=full_data,
        secure_mode=secure_mode,
    )
    write_configs(out, picked, objectives, pick)
    console.print(f"wrote {len(picked)} config(s) to {out}; run: dpivon train --config {out}")


@app.command()
@user_errors
def audit(
    optimizer: Opt[str, typer.Option(help="a private optimizer (dp-sgd, dp-ivon-gradsq, ...)")],
    dataset: Opt[str | None, typer.Option(help="synthetic (default) or cifar10")] = None,
    data_path: Opt[
        str | None, typer.Option(help="CIFAR-10 tarball/folder (else $DPIVON_DATA)")
    ] = None,
    synthetic_size: Opt[
        int | None, typer.Option(help="synthetic images, train + validation (default 500)")
    ] = None,
    model: Opt[str | None, typer.Option(help="small-cnn (default), tanh-cnn, wrn-16-4")] = None,
    epsilon: Opt[float | None, typer.Option(help="claimed epsilon (default 2)")] = None,
    delta: Opt[float | None, typer.Option(help="default 1e-5")] = None,
    canaries: Opt[int, typer.Option(help="gradient canaries, each in with probability 1/2")] = 1000,
    confidence: Opt[float, typer.Option(help="confidence of the lower bound")] = 0.95,
    epochs: Opt[int | None, typer.Option(help="default 5")] = None,
    batch_size: Opt[int | None, typer.Option(help="expected batch size b (default 50)")] = None,
    max_grad_norm: Opt[float, typer.Option(help="per-example clip norm C")] = 1.0,
    lr: Opt[float | None, typer.Option(help="default: the optimizer's")] = None,
    accountant: Opt[str, typer.Option(help="rdp or prv")] = "rdp",
    seed: Opt[int, typer.Option()] = 0,
    device: Opt[str, typer.Option(help="auto, cpu or cuda")] = "auto",
    json_path: Opt[Path | None, typer.Option("--json", help="write the result here")] = None,
    tracking_uri: Opt[
        str | None, typer.Option(help="MLflow URI (default sqlite:///mlflow.db)")
    ] = None,
    experiment: Opt[str, typer.Option(help="MLflow experiment")] = "dpivon",
) -> None:
    """Empirical privacy audit in one run (Steinke, Nasr & Jagielski 2023): a lower bound on
    epsilon from gradient canaries, and a noise-off control that shows the audit's power.
    Exit 1 when the lower bound exceeds the claimed epsilon (a privacy violation)."""
    from dpivon.config import PRIVATE_OPTIMIZERS
    from dpivon.privacy.audit import audit_config, run_audit
    from dpivon.tracking import Tracker

    if optimizer not in PRIVATE_OPTIMIZERS:
        raise DpivonError(
            f"{optimizer!r} is not a private optimizer; audit one of: "
            + ", ".join(PRIVATE_OPTIMIZERS)
        )
    if epsilon is not None and not (epsilon > 0 and math.isfinite(epsilon)):
        raise DpivonError(f"epsilon must be > 0 and finite, got {epsilon}")
    if delta is not None and not 0 < delta < 1:
        raise DpivonError(f"delta must be in (0, 1), got {delta}")
    if canaries < 1:
        raise DpivonError(f"canaries must be >= 1, got {canaries}")
    if not 0 < confidence < 1:
        raise DpivonError(f"confidence must be in (0, 1), got {confidence}")
    cfg = audit_config(
        **_given(
            optimizer=optimizer,
            dataset=dataset,
            data_path=data_path,
            synthetic_size=synthetic_size,
            model=model,
            epsilon=epsilon,
            delta=delta,
            epochs=epochs,
            batch_size=batch_size,
            max_grad_norm=max_grad_norm,
            lr=lr,
            accountant=accountant,
            seed=seed,
            device=device,
        )
    )
    check_outputs(json_path, experiment)
    tracker = Tracker(tracking_uri, experiment)
    console.print(f"tracking to {tracker.display_uri} (experiment {experiment!r})")
    name = f"audit-{optimizer}-eps{cfg.epsilon:g}"
    with tracker.run(name, tags={"dpivon.kind": "audit"}) as run_id:
        tracker.log_params(
            run_id, {**cfg.model_dump(mode="json"), "canaries": canaries, "confidence": confidence}
        )
        result = run_audit(cfg, canaries, confidence=confidence, progress=sys.stderr.isatty())
        summary = {**result.summary(), "mlflow_run_id": run_id}
        tracker.log_metrics(
            run_id, {k: v for k, v in summary.items() if isinstance(v, int | float)}
        )
        tracker.log_dict(run_id, summary, "audit.json")
    table = Table(title="one-run privacy audit", show_header=False)
    for key, value in summary.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(summary, indent=2) + "\n")
        console.print(f"wrote {json_path}")
    claimed, bound = result.claimed_epsilon, result.real.epsilon_lower_bound
    if result.control.epsilon_lower_bound <= claimed:
        console.print(
            f"[yellow]note:[/] the noise-off control certifies only "
            f"{result.control.epsilon_lower_bound:.3g} <= {claimed:g}: this audit could not "
            "have seen a violation; use more canaries or epochs",
            highlight=False,
        )
    if bound > claimed:
        console.print(
            f"[bold red]privacy violation:[/] epsilon >= {bound:.3g} at {confidence:.0%} "
            f"confidence, above the claimed {claimed:g}",
            highlight=False,
        )
        raise typer.Exit(1)
    console.print(
        f"epsilon lower bound {bound:.3g} <= claimed {claimed:g} (control "
        f"{result.control.epsilon_lower_bound:.3g}) at {confidence:.0%} confidence",
        highlight=False,
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
