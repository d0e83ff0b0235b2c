"""The `dpivon` command line: train one run, sweep, inspect the Pareto front, export."""

from __future__ import annotations

import functools
import inspect
import json
import math
import sys
import tempfile
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from typer._click import exceptions as click_errors  # typer 0.29 vendors its click

from dpivon.config import field_info, load_configs, parse_assignments, parse_config
from dpivon.errors import DpivonError
from dpivon.logs import quiet_known_output
from dpivon.process import configure_process


class _OneLineUsageErrors(typer.core.TyperGroup):
    """Usage errors (a flag's bad value, an unknown option) as one line and exit 2, like
    every other input error, instead of click's usage panel."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click_errors.NoArgsIsHelpError:
            sys.exit(2)  # the help is on the screen already
        except click_errors.UsageError as err:
            where = err.ctx.command_path if err.ctx is not None else "dpivon"
            message = " ".join(err.format_message().split())
            console.print(
                f"[bold red]error:[/] {message} (see {where} --help)",
                highlight=False,
                soft_wrap=True,
            )
            sys.exit(2)
        except click_errors.ClickException as err:
            console.print(f"[bold red]error:[/] {err.format_message()}", highlight=False)
            sys.exit(err.exit_code)
        except click_errors.Abort:
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_OneLineUsageErrors,
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Private, uncertainty-aware training (DP-IVON-Gradsq and baselines) and sweeps.",
)
console = Console(stderr=True)


def user_errors(command: Callable) -> Callable:
    """Bad input (a DpivonError or the library's other ValueErrors) becomes one red line
    and exit code 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except ValueError as err:
            message = " ".join(str(err).split())  # one line, whatever the message holds
            console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def _flag_type(annotation: Any) -> tuple[type, str]:
    """The Python type a flag parses to, and the choices of a Literal field."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is Literal:
        return str, ", ".join(map(str, typing.get_args(annotation)))
    return annotation, ""


def config_flags(*keys: str) -> Callable[[Callable], Callable]:
    """Give a command one ``--flag`` per flat config key, typed and described by the config
    tree, plus ``--set PATH=VALUE`` for every other option. The command receives the given
    ones as ``config_values`` (flat keys; None = not given)."""

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command)
        own = [p for p in signature.parameters.values() if p.name != "config_values"]
        flags = []
        for key in keys:
            path, info = field_info(key)
            flag_type, choices = _flag_type(info.annotation)
            default = "per optimizer" if info.is_required() else info.default
            help_text = f"{path}" + (f": {choices}" if choices else "") + f" [default: {default}]"
            option = typer.Option(help=help_text, show_default=False)
            flags.append(
                inspect.Parameter(
                    key,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=None,
                    annotation=Annotated[flag_type | None, option],
                )
            )
        assignments = inspect.Parameter(
            "set_values",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[
                list[str] | None,
                typer.Option(
                    "--set",
                    metavar="PATH=VALUE",
                    help="any config option by its path, e.g. --set optimizer.hess_floor=1e-3 "
                    "(repeatable; values are YAML)",
                ),
            ],
        )

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = {key: kwargs.pop(key) for key in keys}
            values = {k: v for k, v in given.items() if v is not None}
            extra = parse_assignments(kwargs.pop("set_values") or [])
            twice = sorted(set(values) & set(extra))
            if twice:
                raise DpivonError(f"{twice[0]} given both as --{twice[0].replace('_', '-')} "
                                  "and with --set; give it once")  # fmt: skip
            return command(*args, config_values={**values, **extra}, **kwargs)

        hints = typing.get_type_hints(command, include_extras=True)
        parameters = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[p.name]) for p in own
        ]
        parameters += [*flags, assignments]
        wrapper.__signature__ = signature.replace(parameters=parameters)
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        return wrapper

    return decorate


@contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable]:
    """A steps-of-training bar on stderr (stdout stays for results): yields the callback
    that training and audits report their steps to (dpivon.training.StepReport)."""
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )
    tasks: dict[str, Any] = {}

    def on_step(report) -> None:
        if report.task not in tasks:
            tasks[report.task] = bar.add_task(report.task, total=report.total, status="")
        bar.update(tasks[report.task], completed=report.done, status=report.status)

    with bar:
        yield on_step


EPOCH_LINE = (
    "train_loss",
    "val_accuracy",
    "val_ece",
    "val_nll",
    "epsilon_spent",
    "projected_fraction",
    "hess_median",
)


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
    quiet_known_output()
    configure_process()


# `dpivon train`'s flags (scripts rely on these names); every other option: --set PATH=VALUE
TRAIN_FLAGS = (
    "dataset", "data_path", "model", "optimizer", "epsilon", "delta", "accountant", "engine",
    "max_grad_norm", "epochs", "batch_size", "lr", "lr_schedule", "hess_init", "beta2",
    "weight_decay", "mc_samples", "per_class", "val_size", "bma_samples", "val_bma_samples",
    "seed", "secure_mode", "device",
)  # fmt: skip


@app.command()
@user_errors
@config_flags(*TRAIN_FLAGS)
def train(
    config_values: dict[str, Any],
    config: Opt[
        Path | None, typer.Option(help="YAML training config (e.g. from dpivon export)")
    ] = None,
    json_path: Opt[Path | None, typer.Option("--json", help="write the flat result here")] = None,
    tracking_uri: Opt[
        str | None, typer.Option(help="MLflow URI (default sqlite:///mlflow.db)")
    ] = None,
    experiment: Opt[str, typer.Option(help="MLflow experiment")] = "dpivon",
    log_model: Opt[bool, typer.Option(help="log the model (with posterior) to MLflow")] = True,
    profile: Opt[
        bool, typer.Option(help="print where the time went (and add profile_*_s to --json)")
    ] = False,
) -> None:
    """Train one model at a fixed epsilon and track it in MLflow."""
    from dpivon.tracking import Tracker, log_training_result
    from dpivon.training import PhaseTimes, check_fits, load_data
    from dpivon.training import train as run_training

    overrides = config_values
    configs = (
        load_configs(config, overrides)
        if config is not None
        else [parse_config(overrides, source="options")]
    )
    epsilon = overrides.get("epsilon")
    for cfg in configs:
        if not cfg.is_private and epsilon is not None and not math.isinf(epsilon):
            console.print(
                f"[yellow]note:[/] {cfg.optimizer.name} is not private: --epsilon is ignored"
            )
    check_outputs(json_path, experiment)
    phases = [PhaseTimes() for _ in configs]
    datasets = []
    for cfg, times in zip(configs, phases, strict=True):  # bad data fails before any run
        with times.phase("data"):
            datasets.append(load_data(cfg))
    for cfg, data in zip(configs, datasets, strict=True):
        check_fits(cfg, data)
    tracker = Tracker(tracking_uri, experiment)
    console.print(f"tracking to {tracker.display_uri} (experiment {experiment!r})")
    summaries = []
    for cfg, data, times in zip(configs, datasets, phases, strict=True):
        name = f"{cfg.optimizer.name}-eps{cfg.privacy.epsilon:g}"
        with tracker.run(name, tags={"dpivon.kind": "train"}) as run_id:
            tracker.log_params(run_id, cfg.flat())
            tracker.log_text(run_id, cfg.to_yaml(), "config.yaml")

            def log_epoch(report, run_id=run_id, epochs=cfg.training.epochs) -> None:
                tracker.log_metrics(run_id, report.metrics, step=report.epoch)
                shown = {k: report.metrics[k] for k in EPOCH_LINE if k in report.metrics}
                console.print(
                    f"epoch {report.epoch}/{epochs} "
                    + " ".join(f"{k}={v:.4g}" for k, v in shown.items()),
                    highlight=False,
                )

            with progress_bar(sys.stderr.isatty()) as on_step:
                result = run_training(
                    cfg, data=data, on_epoch_end=log_epoch, on_step=on_step, phases=times
                )
            with times.phase("logging"):
                log_training_result(tracker, run_id, result, with_model=log_model)
        summaries.append({**result.summary(), "mlflow_run_id": run_id})
        _print_summary(summaries[-1])
        if profile:
            summaries[-1].update({f"profile_{k}_s": v for k, v in times.seconds.items()})
            _print_profile(times.seconds)
        if "epsilon_covers" in summaries[-1]:
            console.print(summaries[-1]["epsilon_covers"], highlight=False)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        payload = summaries[0] if len(summaries) == 1 else summaries
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
        console.print(f"wrote {json_path}")


def _print_profile(seconds: dict[str, float]) -> None:
    """The phases of one run (dpivon.training.PHASES) with their share of the run."""
    total = sum(seconds.values())
    table = Table(title="profile: where the run's time went")
    for column in ("phase", "seconds", "share"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase, value in seconds.items():
        table.add_row(phase, f"{value:.2f}", f"{value / total:.1%}" if total else "-")
    table.add_row("total", f"{total:.2f}", "100.0%")
    Console().print(table)


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
    from dpivon.search.sweep import SweepInterrupted, run_sweep, sweep_storage

    loaded = load_pipeline(pipeline)
    try:
        trials = run_sweep(loaded, address=address, tracking_uri=tracking_uri, resume=resume)
    except SweepInterrupted as stop:
        console.print(
            f"sweep {loaded.name!r} {stop}; the trials keep their checkpoints: finish it "
            f"with `dpivon sweep {pipeline} --resume`",
            highlight=False,
        )
        raise typer.Exit(stop.exit_code) from None
    counts = trials["status"].value_counts().to_dict()
    console.print(
        f"sweep {loaded.name!r} finished: {counts}; results in "
        f"{sweep_storage(loaded).uri}; open the MLflow UI with `make ui`"
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
        str, typer.Argument(metavar="SWEEP", help="sweep folder or URI, pipeline file or name")
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
    out = out or Path(f"{state.name}-pareto.png")
    plot_fronts_png(trials, state.objectives, out, f"{state.name}: Pareto fronts")
    plot_fronts_html(
        trials, state.objectives, out.with_suffix(".html"), f"{state.name}: Pareto fronts"
    )
    console.print(f"wrote {out} and {out.with_suffix('.html')}")


@app.command()
@user_errors
def export(
    sweep_ref: Opt[
        str, typer.Argument(metavar="SWEEP", help="sweep folder or URI, pipeline file or name")
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


AUDIT_FLAGS = (
    "optimizer", "dataset", "data_path", "synthetic_size", "model", "epsilon", "delta",
    "epochs", "batch_size", "max_grad_norm", "lr", "accountant", "seed", "device",
)  # fmt: skip


@app.command()
@user_errors
@config_flags(*AUDIT_FLAGS)
def audit(
    config_values: dict[str, Any],
    canaries: Opt[int, typer.Option(help="gradient canaries, each in with probability 1/2")] = 1000,
    confidence: Opt[float, typer.Option(help="confidence of the lower bound")] = 0.95,
    json_path: Opt[Path | None, typer.Option("--json", help="write the result here")] = None,
    tracking_uri: Opt[
        str | None, typer.Option(help="MLflow URI (default sqlite:///mlflow.db)")
    ] = None,
    experiment: Opt[str, typer.Option(help="MLflow experiment")] = "dpivon",
) -> None:
    """Empirical privacy audit in one run (Steinke, Nasr & Jagielski 2023): a lower bound on
    epsilon from gradient canaries, and a noise-off control that shows the audit's power.
    Exit 1 when the lower bound exceeds the claimed epsilon (a privacy violation).

    Unless given: synthetic data (500 images), small-cnn, 5 epochs, batch 50, epsilon 2."""
    from dpivon.config import PRIVATE_OPTIMIZERS
    from dpivon.privacy.audit import audit_config, run_audit
    from dpivon.tracking import Tracker

    optimizer = config_values.get("optimizer")
    if optimizer not in PRIVATE_OPTIMIZERS:
        raise DpivonError(
            f"--optimizer {optimizer} is not a private optimizer; audit one of: "
            + ", ".join(PRIVATE_OPTIMIZERS)
        )
    epsilon = config_values.get("epsilon")
    if epsilon is not None and not math.isfinite(epsilon):
        raise DpivonError(
            f"epsilon must be finite (a run without noise claims nothing), got {epsilon}"
        )
    if canaries < 1:
        raise DpivonError(f"canaries must be >= 1, got {canaries}")
    if not 0 < confidence < 1:
        raise DpivonError(f"confidence must be in (0, 1), got {confidence}")
    cfg = audit_config(**config_values)
    check_outputs(json_path, experiment)
    tracker = Tracker(tracking_uri, experiment)
    console.print(f"tracking to {tracker.display_uri} (experiment {experiment!r})")
    name = f"audit-{optimizer}-eps{cfg.privacy.epsilon:g}"
    with tracker.run(name, tags={"dpivon.kind": "audit"}) as run_id:
        tracker.log_params(run_id, {**cfg.flat(), "canaries": canaries, "confidence": confidence})
        with progress_bar(sys.stderr.isatty()) as on_step:
            result = run_audit(cfg, canaries, confidence=confidence, on_step=on_step)
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
