"""The `dpivon` command line: train one run, sweep, inspect the Pareto front, export."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from dpivon.commands import (
    OneLineUsageErrors,
    Opt,
    check_data_source,
    check_outputs,
    config_flags,
    console,
    end_ray,
    progress_bar,
    stops_on_signals,
    user_errors,
    warn_of_frozen_curvature,
    warn_of_research_mode,
)
from dpivon.config import BmaSamples, load_configs, parse_config
from dpivon.constraints import Seed, check_bound
from dpivon.errors import DpivonError
from dpivon.logs import quiet_known_output
from dpivon.orchestration.interrupts import Interrupted
from dpivon.paths import check_writable, named_data_path
from dpivon.process import allocator, configure_process, preload_jemalloc
from dpivon.tracking.layout import KIND_TAG, RunKind

if TYPE_CHECKING:  # dpivon.evaluation.shift loads torchvision: imported where a command needs it
    from dpivon.evaluation.shift import ShiftSet

app = typer.Typer(
    cls=OneLineUsageErrors,
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Private, uncertainty-aware training (DP-IVON-Gradsq and baselines) and sweeps.",
)
# What an epoch's line in the terminal shows
EPOCH_LINE = (
    "train_loss",
    "val_accuracy",
    "val_ece",
    "val_nll",
    "epsilon_spent",
    "projected_fraction",
    "hess_median",
)
# The tag that marks a private run's metrics its epsilon does not cover (--log-train-loss)
NOT_COVERED_TAG = "dpivon.not_covered"
NOT_COVERED_NOTE = (
    "--log-train-loss: the raw training loss is logged; it is computed on the raw batches, "
    "so the run's epsilon does not cover it (tagged dpivon.not_covered)"
)


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
    "seed", "research_mode", "device",
)  # fmt: skip


@app.command()
@stops_on_signals
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
    log_train_loss: Opt[
        bool,
        typer.Option(help="log a private run's raw training loss too (not covered by its epsilon)"),
    ] = False,
    checkpoint: Opt[
        Path | None,
        typer.Option(
            help="save the run's state here after every epoch and, when the file exists, "
            "resume from it in the same MLflow run (no noise key: releasable like the model "
            "and its logged metrics)"
        ),
    ] = None,
    profile: Opt[
        bool, typer.Option(help="print where the time went (and add profile_*_s to --json)")
    ] = False,
    shift: Opt[
        str | None,
        typer.Option(
            help="also score the model under dataset shift, as dpivon evaluate does: the "
            "default set or the full one (test_shift_* in --json and MLflow)"
        ),
    ] = None,
) -> None:
    """Train one model at a fixed epsilon and track it in MLflow."""
    overrides = config_values
    configs = (
        load_configs(config, overrides)
        if config is not None
        else [parse_config(overrides, source="options")]
    )
    for cfg in configs:
        check_data_source(cfg)
    check_outputs(json_path, experiment, tracking_uri)
    shift_set = shift_set_named(shift) if shift is not None else None
    # after the checks above, which need none of them: a mistake is refused in a second
    from dpivon.evaluation.shift import evaluate_shift_as_configured
    from dpivon.runs import (
        NOT_COVERED_METRICS,
        PhaseTimes,
        RunCheckpoint,
        check_fits,
        check_plan_reachable,
        load_data,
        released_metrics,
    )
    from dpivon.runs import train as run_training
    from dpivon.runs.tracked import log_training_result, tracked_run
    from dpivon.tracking.client import Tracker

    for cfg in configs:  # before any data is read: an epsilon no noise can reach
        if cfg.is_private:
            check_plan_reachable(cfg)
    if checkpoint is not None and len(configs) > 1:
        raise DpivonError(f"--checkpoint takes one config; {config} holds {len(configs)}")
    saved = RunCheckpoint.load(checkpoint, configs[0]) if checkpoint is not None else None
    if saved is not None:  # a file of layout 1 held the noise key: it is rewritten without
        saved.save(checkpoint)
    phases = [PhaseTimes() for _ in configs]
    datasets = []
    for cfg, times in zip(configs, phases, strict=True):  # bad data fails before any run
        with times.phase("data"):
            datasets.append(load_data(cfg))
    for cfg, data in zip(configs, datasets, strict=True):
        check_fits(cfg, data)
    warn_of_research_mode(any(c.privacy.research_mode and c.is_private for c in configs))
    tracker = Tracker(tracking_uri, experiment)
    warn_of_frozen_curvature(configs)  # after the last refusal: a frozen h still runs
    console.print(f"tracking to {tracker.display_uri} (experiment {experiment!r})")
    summaries = []
    for cfg, data, times in zip(configs, datasets, phases, strict=True):
        name = f"{cfg.optimizer.name}-eps{cfg.privacy.epsilon:g}"
        tags = {KIND_TAG: RunKind.TRAIN}
        if cfg.is_private and log_train_loss:
            tags[NOT_COVERED_TAG] = ", ".join(NOT_COVERED_METRICS)
            console.print(f"[yellow]note:[/] {NOT_COVERED_NOTE}", highlight=False)
        with tracked_run(
            tracker, cfg, name, tags=tags, resume=saved, train_loss=log_train_loss
        ) as run_id:
            if saved is not None:
                console.print(f"resuming run {run_id} after epoch {saved.epoch} ({checkpoint})")

            def log_epoch(report, run_id=run_id, cfg=cfg) -> None:
                metrics = released_metrics(cfg, report.metrics, train_loss=log_train_loss)
                tracker.log_metrics(run_id, metrics, step=report.epoch)
                if checkpoint is not None:
                    RunCheckpoint.after_epoch(cfg, report, mlflow_run_id=run_id).save(checkpoint)
                shown = {k: metrics[k] for k in EPOCH_LINE if k in metrics}
                console.print(
                    f"epoch {report.epoch}/{cfg.training.epochs} "
                    + " ".join(f"{k}={v:.4g}" for k, v in shown.items()),
                    highlight=False,
                )

            with progress_bar(sys.stderr.isatty()) as on_step:
                result = run_training(
                    cfg,
                    data=data,
                    on_epoch_end=log_epoch,
                    on_step=on_step,
                    resume_state=saved.training if saved is not None else None,
                    phases=times,
                )
            if shift_set is not None:
                with times.phase("test"):
                    shifted = evaluate_shift_as_configured(
                        cfg, result.model, result.posterior, data.test_images, shift_set
                    )
                result = replace(  # logged and summarised as test_*, the sets as shift.json
                    result,
                    test={**result.test, **shifted.by_severity()},
                    shift_record=shifted.record(),
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
    """The phases of one run (dpivon.runs.PHASES) with their share of the run."""
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
    if "curvature_horizon_share" in summary:  # an IVON-family run: did its curvature learn?
        table.add_row("curvature_horizon_share", f"{summary['curvature_horizon_share']:.3f}")
        table.add_row(
            "curvature_learned_share",
            "{curvature_learned_share_median:.3f} (q10 {curvature_learned_share_q10:.3f}, "
            "q90 {curvature_learned_share_q90:.3f})".format(**summary),
        )
        if "curvature_update_share" in summary:
            table.add_row("curvature_update_share", f"{summary['curvature_update_share']:.3g}")
    Console().print(table)


# The options of the commands that run a pipeline on Ray (sweep, benchmark)
RayAddress = Opt[
    str | None, typer.Option(help="Ray cluster address (else $RAY_ADDRESS, else a local Ray)")
]
PipelineTrackingUri = Opt[str | None, typer.Option(help="MLflow URI (overrides the pipeline)")]


@app.command()
@user_errors
def sweep(
    pipeline: Opt[Path, typer.Argument(help="pipeline YAML, e.g. pipelines/quickstart.yaml")],
    resume: Opt[bool, typer.Option(help="continue this pipeline's interrupted sweep")] = False,
    address: RayAddress = None,
    tracking_uri: PipelineTrackingUri = None,
) -> None:
    """Run a hyper-parameter sweep: Ray Tune trials, Optuna search, MLflow tracking."""
    from dpivon.search.pipeline import load_pipeline
    from dpivon.search.sweep import SweepInterrupted, run_sweep

    loaded = load_pipeline(pipeline)
    warn_of_research_mode(loaded.research_mode)
    try:
        trials = run_sweep(loaded, address=address, tracking_uri=tracking_uri, resume=resume)
    except SweepInterrupted as stop:
        console.print(
            f"sweep {loaded.name!r} {stop}; the trials keep their checkpoints: finish it "
            f"with `dpivon sweep {pipeline} --resume`",
            highlight=False,
        )
        raise typer.Exit(stop.exit_code) from None
    # a trial count the random-trials bound keeps private is not printed either
    counts = "" if loaded.hides_trial_count else f": {trials['status'].value_counts().to_dict()}"
    console.print(
        f"sweep {loaded.name!r} finished{counts}; results in "
        f"{loaded.storage.uri}; open the MLflow UI with `make ui`"
    )


@app.command()
@user_errors
def benchmark(
    pipeline: Opt[
        Path, typer.Argument(help="benchmark YAML, e.g. pipelines/benchmark-cifar10-4k.yaml")
    ],
    resume: Opt[
        bool,
        typer.Option(help="skip runs MLflow records as completed, continue interrupted ones"),
    ] = False,
    report_only: Opt[
        bool, typer.Option(help="train nothing: the report of the runs completed so far")
    ] = False,
    address: RayAddress = None,
    tracking_uri: PipelineTrackingUri = None,
) -> None:
    """Train every method x epsilon x seed on Ray, aggregate over seeds, write the report.
    Exit 1 when some run failed (the report covers the others; --resume reruns them)."""
    from dpivon.study.benchmark import run_benchmark
    from dpivon.study.report_numbers import results_rows
    from dpivon.study.spec import load_benchmark

    if resume and report_only:
        raise DpivonError("--resume trains and --report-only does not: pass one of them")
    loaded = load_benchmark(pipeline)
    warn_of_research_mode(loaded.research_mode and not report_only)
    if not (resume or report_only):  # a resume was warned when it started
        warn_of_frozen_curvature(run.config for run in loaded.runs)
    try:
        outcome = run_benchmark(
            loaded,
            address=address,
            tracking_uri=tracking_uri,
            resume=resume,
            report_only=report_only,
        )
    except Interrupted as stop:
        console.print(
            f"benchmark {loaded.name!r} {stop}; its runs keep their last epoch: continue "
            f"with `dpivon benchmark {pipeline} --resume`",
            highlight=False,
        )
        raise typer.Exit(stop.exit_code) from None
    header, rows = results_rows(outcome.report.table)
    table = Table(title=f"benchmark {loaded.name}: mean [95 % interval] over seeds")
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
    from dpivon.search.pareto_views import plot_fronts_html, plot_fronts_png, print_front_table
    from dpivon.search.sweep import SweepState

    if out is not None:
        check_writable(out, "--out")
        check_writable(out.with_suffix(".html"), "--out")
    directory = resolve_sweep(sweep_ref)
    state = SweepState.load(directory)
    trials, front = load_results(directory)
    # the group's budget is the front's `epsilon`; under total_epsilon a trial spent less
    spent = "trial_epsilon" in front and (front["trial_epsilon"] != front["epsilon"]).any()
    extra = ["trial_epsilon"] if spent else []
    extra += [
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
    if out is None:
        out = Path(f"{state.name}-pareto.png")
        check_writable(out, "the plot")
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
    pick: Opt[
        str | None,
        typer.Option(
            help="knee, max-accuracy, min-ece or pareto [default: the sweep's release pick "
            "(release: best), else knee]"
        ),
    ] = None,
    optimizer: Opt[str | None, typer.Option(help="only this optimizer's front")] = None,
    epsilon: Opt[float | None, typer.Option(help="only this epsilon's front")] = None,
    epochs: Opt[int | None, typer.Option(help="production epochs (default: the sweep's)")] = None,
    full_data: Opt[bool, typer.Option(help="train on the full training set")] = True,
    research_mode: Opt[
        bool,
        typer.Option(
            help="noise reproducible from the seed: no DP guarantee (default: secure noise)"
        ),
    ] = False,
) -> None:
    """Write the chosen Pareto-optimal configurations as production training configs."""
    from dpivon.search.export import departure, export_configs, resolve_sweep, write_configs
    from dpivon.search.sweep import SweepState

    check_writable(out, "--out")
    directory = resolve_sweep(sweep_ref)
    state = SweepState.load(directory)
    objectives = state.objectives
    if (note := departure(directory, pick)) is not None:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    pick = pick or state.release_pick or "knee"
    picked = export_configs(
        directory,
        objectives,
        pick,
        optimizer=optimizer,
        epsilon=epsilon,
        epochs=epochs,
        full_data=full_data,
        research_mode=research_mode,
    )
    write_configs(out, picked, objectives, pick)
    console.print(f"wrote {len(picked)} config(s) to {out}; run: dpivon train --config {out}")


AUDIT_FLAGS = (
    "optimizer", "dataset", "data_path", "synthetic_size", "model", "epsilon", "delta",
    "epochs", "batch_size", "max_grad_norm", "lr", "accountant", "seed", "device",
)  # fmt: skip


@app.command()
@user_errors
@config_flags(*AUDIT_FLAGS, required=("optimizer",))
def audit(
    config_values: dict[str, Any],
    canaries: Opt[int, typer.Option(help="canaries, each in with probability 1/2")] = 2000,
    confidence: Opt[float, typer.Option(help="confidence of the lower bound")] = 0.95,
    json_path: Opt[Path | None, typer.Option("--json", help="write the result here")] = None,
    tracking_uri: Opt[
        str | None, typer.Option(help="MLflow URI (default sqlite:///mlflow.db)")
    ] = None,
    experiment: Opt[str, typer.Option(help="MLflow experiment")] = "dpivon",
) -> None:
    """Empirical privacy audit in one run: canaries with gradients of norm 10 C through the
    model's last layer and the engine's clipping, a Gaussian-DP mu certified from them (and
    the looser bound of Steinke, Nasr & Jagielski 2023), and a noise-off control that shows
    the audit's power. Exit 1 when the certified mu exceeds the claimed mechanism's, the
    bound exceeds the claimed epsilon, or the gradients carry less noise than accounted.

    Unless given: synthetic data (500 images), small-cnn, 5 epochs, batch 50, epsilon 2."""
    from dpivon.audit import audit_config, check_audit, run_audit
    from dpivon.runs import check_fits, check_plan_reachable, load_data
    from dpivon.runs.tracked import tracked_run
    from dpivon.tracking.client import Tracker

    cfg = audit_config(**config_values)
    check_audit(cfg, canaries, confidence)
    check_plan_reachable(cfg)
    check_outputs(json_path, experiment, tracking_uri)
    data = load_data(cfg)  # a missing path, a batch above N, the device: before any run
    check_fits(cfg, data)
    tracker = Tracker(tracking_uri, experiment)
    console.print(f"tracking to {tracker.display_uri} (experiment {experiment!r})")
    name = f"audit-{cfg.optimizer.name}-eps{cfg.privacy.epsilon:g}"
    audit_params = {"canaries": canaries, "confidence": confidence}
    tags = {KIND_TAG: RunKind.AUDIT}
    with tracked_run(tracker, cfg, name, tags=tags, params=audit_params) as run_id:
        with progress_bar(sys.stderr.isatty()) as on_step:
            result = run_audit(cfg, canaries, confidence=confidence, data=data, on_step=on_step)
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
    claimed, certified = result.claimed_epsilon, result.real.epsilon_certified
    if result.control.mu_lower_bound <= result.claimed_mu:
        console.print(
            f"[yellow]note:[/] the noise-off control certifies only mu "
            f"{result.control.mu_lower_bound:.3g} <= the claimed {result.claimed_mu:.3g}: this "
            "audit could not have seen a violation; use more canaries or epochs",
            highlight=False,
        )
    if violations := result.violations():
        line = f"[bold red]privacy violation:[/] {'; '.join(violations)}"
        console.print(line, highlight=False, soft_wrap=True)  # one line, however long
        raise typer.Exit(1)
    console.print(
        f"certified epsilon {certified:.3g} <= claimed {claimed:g} (Gaussian-DP mu "
        f"{result.real.mu_lower_bound:.3g} <= {result.claimed_mu:.3g}, control "
        f"{result.control.mu_lower_bound:.3g}) at {confidence:.0%} confidence; noise "
        f"{result.noise_ratio:.0%} of the accounted",
        highlight=False,
    )


# A model folder whose loader or code differs from the installed dpivon's is refused
# (dpivon.tracking.model_trust): loading it would run that code.
ModelTrackingUri = Opt[
    str | None,
    typer.Option(help="MLflow URI for runs:/ and models:/ (default sqlite:///mlflow.db)"),
]
TrustModelCode = Opt[
    bool,
    typer.Option(
        "--trust-model-code",
        help="load a model whose code is not the installed dpivon's (it runs that code)",
    ),
]


@app.command()
@user_errors
def predict(
    model_uri: Opt[
        str,
        typer.Argument(help="an MLflow model: runs:/RUN_ID/model, models:/NAME/VERSION, a path"),
    ],
    images: Opt[list[Path], typer.Argument(help="PNG/JPEG files, folders of them, .npy batches")],
    json_output: Opt[bool, typer.Option("--json", help="print every column as JSON")] = False,
    bma_samples: Opt[
        int | None,
        typer.Option(min=0, help="posterior draws (IVON family; 0: the mean) [default: the model]"),
    ] = None,
    seed: Opt[int, typer.Option(min=0, help="seed of the posterior draws")] = 0,
    cifar_normalised: Opt[
        bool, typer.Option(help="a .npy batch of floats already CIFAR-normalised")
    ] = False,
    trust_model_code: TrustModelCode = False,
    tracking_uri: ModelTrackingUri = None,
) -> None:
    """Classify images with a logged model: class, probability, entropy (and, for the IVON
    family, the mutual information across posterior draws) per image."""
    from dpivon.data.images import read_images
    from dpivon.tracking.served_model import load_pyfunc

    if bma_samples is not None:
        check_bound(BmaSamples, "--bma-samples", bma_samples)
    check_bound(Seed, "--seed", seed)
    names, batch = read_images(images)  # bad files fail before the model loads
    model = load_pyfunc(model_uri, tracking_uri, trust_model_code)
    params = {"seed": seed, "cifar_normalised": cifar_normalised}
    if bma_samples is not None:
        params["bma_samples"] = bma_samples
    rows = model.predict(batch, params=params)
    rows.insert(0, "file", names)
    if json_output:  # full precision: the answer of a served model compares equal
        print(json.dumps(rows.to_dict("records"), indent=2))
        return
    numbers = [c for c in ("probability", "entropy", "mutual_information") if c in rows]
    table = Table(title=f"{model_uri}: {len(rows)} image(s)")
    for column in ("file", "class", *numbers):
        table.add_column(column, justify="left" if column in ("file", "class") else "right")
    for row in rows.to_dict("records"):
        table.add_row(
            row["file"], f"{row['label']} ({row['class']})", *(f"{row[c]:.4f}" for c in numbers)
        )
    Console(width=200).print(table)


@app.command()
@user_errors
def serve(
    model_uri: Opt[
        str,
        typer.Argument(help="an MLflow model: runs:/RUN_ID/model, models:/NAME/VERSION, a path"),
    ],
    host: Opt[str, typer.Option(help="the address to listen on")] = "127.0.0.1",
    port: Opt[int, typer.Option(min=1, max=65535, help="the port to listen on")] = 5001,
    trust_model_code: TrustModelCode = False,
    tracking_uri: ModelTrackingUri = None,
) -> None:
    """Serve a logged model over REST (MLflow's scoring server in this environment: POST
    images to /invocations) until Ctrl-C or SIGTERM, once its code is checked."""
    from dpivon.tracking.served_model import serve_model

    raise typer.Exit(serve_model(model_uri, host, port, tracking_uri, trust_model_code))


def shift_set_named(name: str) -> ShiftSet:
    """The shift set ``default`` or ``full`` (`dpivon.evaluation.shift.SHIFT_SETS`)."""
    from dpivon.evaluation.shift import SHIFT_SETS

    if name not in SHIFT_SETS:
        raise DpivonError(f"--shift takes {' or '.join(SHIFT_SETS)}, got {name!r}")
    return SHIFT_SETS[name]


# the columns of `dpivon evaluate`'s table: (metric, header, format)
SHIFT_COLUMNS = (
    ("accuracy", "accuracy", ".3f"),
    ("nll", "NLL", ".3f"),
    ("ece", "ECE", ".3f"),
    ("aurc_maxprob", "AURC", ".3f"),
    ("acc_at_90_maxprob", "acc@90%", ".3f"),
    ("acc_at_80_maxprob", "acc@80%", ".3f"),
    ("auroc_maxprob", "AUROC max-p", ".3f"),
    ("auroc_entropy", "AUROC entropy", ".3f"),
    ("auroc_mi", "AUROC MI", ".3f"),
)


def _print_shift(title: str, by_severity: dict[str, float]) -> None:
    """One row per severity (0: clean) of the means over the corruptions."""
    severities = sorted({int(k.split("_")[1][1:]) for k in by_severity})
    columns = [c for c in SHIFT_COLUMNS if f"shift_s0_{c[0]}" in by_severity]
    table = Table(title=title)
    table.add_column("severity")
    for _, header, _ in columns:
        table.add_column(header, justify="right")
    for severity in severities:
        cells = [f"{by_severity[f'shift_s{severity}_{m}']:{fmt}}" for m, _, fmt in columns]
        table.add_row("clean" if severity == 0 else str(severity), *cells)
    Console(width=200).print(table)


@app.command()
@user_errors
def evaluate(
    model_uri: Opt[
        str,
        typer.Argument(
            help="runs:/RUN_ID/model, models:/NAME/VERSION, a model folder, or a model file "
            "(a sweep trial's model.pt, committed weights)"
        ),
    ],
    corruption: Opt[
        list[str] | None,
        typer.Option(help="a corruption (repeatable) [default: the set's]"),
    ] = None,
    severity: Opt[
        list[int] | None, typer.Option(help="a severity 1-5 (repeatable) [default: 1-5]")
    ] = None,
    full: Opt[
        bool, typer.Option("--full", help="the full set: 19 corruptions, every test image")
    ] = False,
    per_class: Opt[
        int | None,
        typer.Option(help="test images per class [default: 50; every image with --full]"),
    ] = None,
    data_path: Opt[
        Path | None, typer.Option(help="CIFAR-10 (default: $DPIVON_DATA, then the cache)")
    ] = None,
    bma_samples: Opt[
        int | None,
        typer.Option(min=0, help="posterior draws (IVON family; 0: the mean) [default: the model]"),
    ] = None,
    seed: Opt[int, typer.Option(min=0, help="seed of the posterior draws")] = 0,
    json_path: Opt[Path | None, typer.Option("--json", help="write every number here")] = None,
    trust_model_code: TrustModelCode = False,
    tracking_uri: ModelTrackingUri = None,
) -> None:
    """Score a logged or saved model under dataset shift, without retraining: accuracy, NLL,
    ECE, selective prediction (AURC, accuracy at 90 % and 80 % coverage) and error detection
    (AUROC of max-probability, entropy, mutual information) on the clean test images and on
    CIFAR-10-C-style corruptions at severities 1-5 (made once, then cached)."""
    from dpivon.data import load_test_images
    from dpivon.data.arrays import class_counts
    from dpivon.evaluation.shift import ShiftSet, check_shift_request, evaluate_shift
    from dpivon.runs import synthetic_sizes
    from dpivon.tracking.served_model import load_scored_model

    base = shift_set_named("full" if full else "default")
    shift_set = ShiftSet(
        tuple(corruption) if corruption else base.corruptions,
        tuple(severity) if severity else base.severities,
        per_class if per_class is not None else base.per_class,
    )
    check_shift_request(shift_set.corruptions, shift_set.severities)
    if bma_samples is not None:
        check_bound(BmaSamples, "--bma-samples", bma_samples)
    check_bound(Seed, "--seed", seed)
    if json_path is not None:
        check_writable(json_path, "--json")
    if data_path is not None:  # a given path that does not exist: refused before the model
        named_data_path(data_path)
    config, model, posterior = load_scored_model(model_uri, tracking_uri, trust_model_code)
    synthetic = config.data.dataset == "synthetic"
    if synthetic and data_path is not None:
        raise DpivonError(
            f"--data-path {data_path} names CIFAR-10, but {model_uri} was trained on synthetic "
            "images and is scored on its own synthetic test set: drop --data-path"
        )
    named = None if synthetic else named_data_path(data_path)  # or $DPIVON_DATA
    origin = f" from {named[0]}" if named else " from the cache"
    source = "synthetic test images" if synthetic else f"CIFAR-10 test images{origin}"
    test = load_test_images(
        config.data.dataset,
        data_path=data_path,
        seed=config.split_seed,
        synthetic_sizes=synthetic_sizes(config),
    )
    most = int(class_counts(test).max())
    if per_class is not None and per_class > most:
        raise DpivonError(
            f"--per-class {per_class} is above the {most} {source} of the largest class: "
            f"give at most {most} (or --full for every image)"
        )
    samples = config.evaluation.bma_samples if bma_samples is None else bma_samples
    result = evaluate_shift(
        model, posterior, test, shift_set,
        bma_samples=samples, seed=seed, n_bins=config.evaluation.ece_bins,
    )  # fmt: skip
    by_severity = result.by_severity()
    _print_shift(
        f"{model_uri} ({config.optimizer.name}): {result.images} {source} per set (severity "
        f"0) and their corruptions, means over {len(shift_set.corruptions)} corruption(s)",
        by_severity,
    )
    sets = len(result.rows)
    console.print(
        f"{sets} sets of {result.images} images: {result.seconds['predict_s']:.1f} s predicting "
        f"({result.seconds['predict_cpu_s']:.1f} s of CPU; "
        f"{samples if posterior is not None else 0} posterior draws), "
        f"{result.seconds['corrupt_s']:.1f} s making or reading the corrupted sets",
        highlight=False,
    )
    if json_path is not None:
        payload = {
            "model_uri": model_uri,
            "optimizer": config.optimizer.name,
            "bma_samples": samples if posterior is not None else 0,
            "seed": seed,
            "images": result.images,
            "data_source": source,
            "corruptions": list(shift_set.corruptions),
            "severities": list(shift_set.severities),
            **result.record(),
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
        console.print(f"wrote {json_path}")


def main() -> None:
    """The `dpivon` command: restarted on jemalloc first (`dpivon.process`), then the app.
    A request for help trains nothing: it is answered without the restart."""
    try:
        if len(sys.argv) > 1 and "--help" not in sys.argv[1:]:
            preload_jemalloc()
        else:
            allocator()  # a help request restarts on none, but a bad choice is still said
    except DpivonError as err:
        console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        sys.exit(2)
    try:
        app()
    finally:
        if (stopped := end_ray()) is not None:
            sys.exit(stopped)


if __name__ == "__main__":
    main()
