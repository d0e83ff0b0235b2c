"""`dpivon benchmark`: every (method, epsilon, seed) trained once on Ray, tracked in MLflow.

Each run is one Ray task (the resources of the pipeline): the one `dpivon.runs.train`,
then the test set evaluated with train's own evaluation, a temperature fitted on the
validation predictive (`dpivon.evaluation.calibration`) and the tempered test predictive scored.
The driver alone writes MLflow, like a sweep's: one parent run per benchmark, one child
run per (method, epsilon, seed), created when the run is submitted and filled in when it
returns (per-epoch history, final metrics, reliability bins). Every wait has a deadline:
results are polled, and a run past ``run_timeout_s`` is cancelled and recorded as failed.

State lives in ``<storage_path>/<name>/benchmark.json`` (the parent run). ``--resume``
reuses the parent and skips every child that MLflow records as completed; a child that was
running, failed or cancelled runs again in the same MLflow run, from its last finished
epoch where its `RunCheckpoint` holds one. A run is only skipped or continued if its
configuration is the one the pipeline asks for now (a config hash on the child, the config
itself in the checkpoint).
"""

from __future__ import annotations

import io
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import ray
from ray.util.queue import Queue
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dpivon.data import DataSplits
from dpivon.errors import DpivonError
from dpivon.evaluation.metrics import (
    ReliabilityDiagram,
)
from dpivon.evaluation.shift import SHIFT_SETS
from dpivon.orchestration.folder_lock import FolderLock
from dpivon.orchestration.interrupts import signals_interrupt
from dpivon.orchestration.provenance import provenance
from dpivon.orchestration.ray_cluster import check_fits_here, connect
from dpivon.orchestration.state_file import RunState
from dpivon.orchestration.storage import ResultsStorage
from dpivon.privacy.noise import noise_statement, noise_tags
from dpivon.runs import (
    TrainResult,
    load_data,
    released_metrics,
)
from dpivon.runs.result import tuning_touched
from dpivon.runs.tracked import epsilon_tags, log_training_result
from dpivon.study.aggregate import load_records
from dpivon.study.attribution import add_attribution_blocks
from dpivon.study.benchmark_report import Report, build_report, log_report, write_report
from dpivon.study.benchmark_run import CheckpointPlace, config_hash, run_in_worker
from dpivon.study.layout import (
    CONFIG_HASH_TAG,
    KEY_TAG,
    RELIABILITY_FILE,
    STATUS_TAG,
    is_completed,
    weights_file,
)
from dpivon.study.rescoring import score_stored_weights_under_shift, score_weight_noise_averaging
from dpivon.study.shift_report import add_shift_blocks
from dpivon.study.spec import BenchmarkPipeline, RunSpec, run_key
from dpivon.tracking.client import Tracker, check_store_exists
from dpivon.tracking.layout import (
    EPSILON_TAG,
    ERROR_LIMIT,
    ERROR_TAG,
    KIND_TAG,
    OPTIMIZER_TAG,
    RunKind,
    RunOutcome,
)
from dpivon.tracking.model_file import save_model_file

REPORT_DIR = "report"
GET_TIMEOUT_S = 300.0  # fetching the result of a task Ray reports as finished
POLL_S = 5.0  # how long one wait for a finished run lasts before deadlines are checked
RESUMED_TAG = "dpivon.resumed_after_epoch"
console = Console(stderr=True)


@dataclass
class BenchmarkState(RunState):
    """What a resumed driver needs: the parent run of this benchmark."""

    file_name: ClassVar[str] = "benchmark.json"
    kind: ClassVar[str] = "benchmark"


@dataclass
class BenchmarkOutcome:
    """The parent run and what happened to the runs of this invocation."""

    parent_run_id: str
    tracker: Tracker
    skipped: int
    completed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # run key -> error line
    report: Report | None = None
    report_files: list[str] = field(default_factory=list)  # report.md, report.html, ...


# --- MLflow layout --------------------------------------------------------------------------


def reliability_to_dict(diagram: ReliabilityDiagram) -> dict[str, list]:
    return {
        "bin_edges": diagram.bin_edges.tolist(),
        "bin_accuracy": [None if math.isnan(v) else v for v in diagram.bin_accuracy.tolist()],
        "bin_confidence": [None if math.isnan(v) else v for v in diagram.bin_confidence.tolist()],
        "bin_count": diagram.bin_count.tolist(),
    }


def _child_tags(spec: RunSpec) -> dict[str, str]:
    tags = {
        KEY_TAG: spec.key,
        CONFIG_HASH_TAG: config_hash(spec),
        STATUS_TAG: RunOutcome.RUNNING,
        KIND_TAG: RunKind.BENCHMARK_RUN,
        "dpivon.method": spec.method,
        OPTIMIZER_TAG: spec.config.optimizer.name,
        EPSILON_TAG: f"{spec.epsilon:g}",
        "dpivon.replicate": str(spec.replicate),
        **noise_tags(spec.config.privacy.research_mode, spec.config.is_private),
    }
    if spec.tuned_by:
        tags["dpivon.tuned_by"] = spec.tuned_by
    return tags


def _open_child(tracker: Tracker, parent: str, spec: RunSpec, existing) -> str:
    """The child run of ``spec``: a new one, or the unfinished one of an earlier attempt."""
    if existing is not None:
        run_id = existing.info.run_id
        tracker.set_tags(run_id, {STATUS_TAG: RunOutcome.RUNNING, ERROR_TAG: ""})
        tracker.set_run_status(run_id, "RUNNING")
        return run_id
    run_id = tracker.start_run(
        f"{spec.method}-eps{spec.epsilon:g}-seed{spec.replicate}",
        parent_run_id=parent,
        tags=_child_tags(spec),
    )
    tracker.log_params(
        run_id,
        {**spec.config.flat(), "method": spec.method, "replicate": spec.replicate},
    )
    return run_id


def _log_result(tracker: Tracker, run_id: str, result: TrainResult) -> None:
    """Per-epoch history, final metrics, summary, reliability bins and diagram, the model."""
    for metrics in result.history:
        released = released_metrics(result.config, metrics)
        tracker.log_metrics(run_id, released, step=int(metrics["epoch"]))
    log_training_result(tracker, run_id, result)  # with its model: dpivon predict takes it
    if "temperature" in result.extra:
        tracker.log_metrics(
            run_id, {"temperature": result.extra["temperature"]}, result.config.training.epochs
        )
    if result.test_reliability is not None:
        tracker.log_dict(run_id, reliability_to_dict(result.test_reliability), RELIABILITY_FILE)
    tracker.set_tags(run_id, {STATUS_TAG: RunOutcome.COMPLETED})
    tracker.end_run(run_id, "FINISHED")


def _store_weights(storage: ResultsStorage, spec: RunSpec, result: TrainResult) -> None:
    """The run's released model as one file in the benchmark's folder, so that later
    evaluations (calibration under shift, new metrics) need no retraining."""
    buffer = io.BytesIO()
    save_model_file(buffer, result.config, result.model, result.posterior)
    storage.write_bytes(weights_file(spec.key), buffer.getvalue())


def _fail(tracker: Tracker, run_id: str, message: str, status: str = "FAILED") -> None:
    tracker.set_tags(run_id, {STATUS_TAG: RunOutcome.FAILED, ERROR_TAG: message[:ERROR_LIMIT]})
    tracker.end_run(run_id, status)


def error_line(err: BaseException) -> str:
    """The original exception of a failed Ray task, in one line."""
    cause = getattr(err, "cause", None) or err
    text = f"{type(cause).__name__}: {cause}"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(cause).__name__


# --- the driver -----------------------------------------------------------------------------


def _describe_plan(tracker: Tracker, parent: str, pipeline: BenchmarkPipeline) -> None:
    """The parent's plan as this invocation runs it: a resume may add methods, epsilons or
    seeds, so these are tags (a param cannot change) and pipeline.yaml is written again."""
    tracker.set_tags(
        parent,
        {
            "methods": ",".join(pipeline.method_names),
            "epsilons": ",".join(f"{e:g}" for e in pipeline.epsilon_list),
            "seeds": ",".join(map(str, pipeline.seeds)),
            "runs": str(len(pipeline.runs)),
        },
    )
    tracker.log_text(parent, pipeline.source_text, "pipeline.yaml")


def _start_or_resume(pipeline: BenchmarkPipeline, tracker: Tracker, resume: bool) -> str:
    storage = pipeline.storage
    if BenchmarkState.exists(storage):
        if not resume:
            raise DpivonError(
                f"benchmark {pipeline.name!r} already exists in {storage.uri}; pass --resume "
                "to continue it, or change the pipeline's name (or delete that folder) to "
                "start over"
            )
        state = BenchmarkState.load(storage)
        tracker.set_run_status(state.parent_run_id, "RUNNING")
        _describe_plan(tracker, state.parent_run_id, pipeline)
        return state.parent_run_id
    if resume:
        console.print(
            f"[yellow]note:[/] nothing to resume in {storage.uri}; starting the benchmark"
        )
    parent = tracker.start_run(
        pipeline.name,
        tags={
            KIND_TAG: RunKind.BENCHMARK,
            "dpivon.benchmark_dir": storage.uri,
            **noise_tags(pipeline.research_mode),
        },
    )
    tracker.log_params(
        parent,
        {
            "benchmark": pipeline.name,
            "split_seed": pipeline.split_seed,
            "delta": pipeline.delta,
            "epochs": pipeline.epochs,
            "model": pipeline.model.name,
            "dataset": pipeline.data.dataset,
            "per_class": pipeline.data.per_class,
            **provenance(),
        },
    )
    _describe_plan(tracker, parent, pipeline)
    # no password in the state file: a resume is given the URI again
    BenchmarkState(
        pipeline.name, str(pipeline.path), tracker.display_uri, tracker.experiment_name, parent
    ).save(storage)
    return parent


def _pending_runs(pipeline: BenchmarkPipeline, existing: dict[str, Any]) -> list[RunSpec]:
    """The runs still to do; refuses to resume runs whose configuration has changed."""
    todo = []
    for spec in pipeline.runs:
        run = existing.get(spec.key)
        if run is not None and run.data.tags.get(CONFIG_HASH_TAG) != config_hash(spec):
            raise DpivonError(
                f"run {spec.key} of benchmark {pipeline.name!r} was started with another "
                "configuration; a resume must not mix them: restore the pipeline, or rename it "
                "to start a new benchmark"
            )
        if run is None or not is_completed(run):
            todo.append(spec)
    return todo


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
    )


def time_left_s(epochs_left: int, epoch_s: list[float], concurrency: int) -> float | None:
    """Wall seconds the benchmark's remaining epochs take at the median epoch measured so far
    (each measured beside the runs in flight with it, so ``concurrency`` of them pass at
    once), or None before any epoch has been measured. The final test and shift scoring of
    each run are not in it: a lower estimate."""
    if not epoch_s:
        return None
    return epochs_left * float(statistics.median(epoch_s)) / concurrency


def duration_text(seconds: float) -> str:
    """``seconds`` in the unit a person plans with: "40 min", "9.5 h"."""
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{max(1, round(seconds / 60))} min"


def _finished_line(spec: RunSpec, result: TrainResult) -> str:
    test = result.test or {}
    return (
        f"[bold]{spec.key}[/] done: test acc {test.get('accuracy', math.nan):.4f}, "
        f"ECE {test.get('ece', math.nan):.4f}, NLL {test.get('nll', math.nan):.4f}, "
        f"{result.wall_time_s:.0f} s"
    )


def execute_runs(
    pipeline: BenchmarkPipeline,
    tracker: Tracker,
    parent: str,
    todo: list[RunSpec],
    existing: dict[str, Any],
    data: DataSplits,
    outcome: BenchmarkOutcome,
) -> None:
    """Submit ``todo`` as Ray tasks, at most ``concurrency`` at a time, and log each result
    as it arrives. Waits are bounded: POLL_S per wait, ``run_timeout_s`` per run."""
    cpu, gpu = pipeline.resources.cpu, pipeline.resources.gpu
    task = ray.remote(num_cpus=cpu, num_gpus=gpu, max_retries=0)(run_in_worker)
    shift_set = SHIFT_SETS.get(pipeline.shift)  # None: "none"
    data_ref = ray.put(data)
    queue = list(todo)
    in_flight: dict[ray.ObjectRef, tuple[RunSpec, str, CheckpointPlace, float]] = {}
    epochs: dict[str, int] = {}  # checkpoint name -> the run's last finished epoch
    last_epoch_at: dict[str, float] = {}  # checkpoint name -> when it reported (or started)
    epoch_s: list[float] = []  # wall seconds of each epoch this invocation saw end
    epochs_done = Queue(actor_options={"num_cpus": 0})  # no CPU: never delays a run
    total = len(pipeline.runs)

    def running_status() -> str:
        running = ", ".join(
            f"{spec.method} {epochs.get(ck.name, 0)}/{spec.config.training.epochs}"
            for spec, _, ck, _ in in_flight.values()
        )
        running = f" ({running})" if running else ""
        epochs_left = sum(
            spec.config.training.epochs - epochs.get(ck.name, 0)
            for spec, _, ck, _ in in_flight.values()
        ) + sum(spec.config.training.epochs for spec in queue)
        at_once = min(pipeline.concurrency, len(in_flight) + len(queue))
        left = time_left_s(epochs_left, epoch_s, max(1, at_once))
        left = f", about {duration_text(left)} left" if left else ""  # None, or all done
        return f"{len(in_flight)} running{running}, {len(outcome.failed)} failed{left}"

    with _progress() as bar:
        progress = bar.add_task(pipeline.name, total=total, completed=total - len(todo), status="")

        def submit(spec: RunSpec) -> None:
            run_id = _open_child(tracker, parent, spec, existing.get(spec.key))
            place = CheckpointPlace.of(pipeline.storage, spec)
            saved = place.load()
            if saved is not None:
                epochs[place.name] = epoch = saved.epoch
                tracker.set_tags(run_id, {RESUMED_TAG: str(epoch)})
                bar.console.print(f"[bold]{spec.key}[/] continues after epoch {epoch}")
            ref = task.remote(
                max(1, int(cpu)), spec.config, data_ref, place, saved, epochs_done, shift_set
            )
            in_flight[ref] = (spec, run_id, place, time.monotonic())
            last_epoch_at[place.name] = time.monotonic()

        def finish(ref, message: str | None = None, status: str = "FAILED") -> None:
            spec, run_id, place, _ = in_flight.pop(ref)
            if message is None:
                try:
                    result = ray.get(ref, timeout=GET_TIMEOUT_S)
                except (ray.exceptions.RayError, TimeoutError) as err:
                    message = error_line(err)
                else:
                    _log_result(tracker, run_id, result)
                    _store_weights(pipeline.storage, spec, result)
                    place.remove()  # the run's record is complete in MLflow
                    outcome.completed.append(spec.key)
                    bar.console.print(_finished_line(spec, result), highlight=False)
            if message is not None:
                _fail(tracker, run_id, message, status)
                if status == "KILLED":  # stopped, not failed: --resume continues it
                    bar.console.print(f"[bold]{spec.key}[/] [yellow]{message}[/]", highlight=False)
                    return
                outcome.failed[spec.key] = message
                bar.console.print(f"[bold]{spec.key}[/] [red]failed[/]: {message}", highlight=False)
            bar.update(progress, advance=1, status=running_status())

        try:
            while queue or in_flight:
                while queue and len(in_flight) < pipeline.concurrency:
                    submit(queue.pop(0))
                bar.update(progress, status=running_status())
                ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=POLL_S)
                for name, epoch in epochs_done.get_nowait_batch(epochs_done.size()):
                    now = time.monotonic()
                    # the first epoch of a run also holds its start-up (data to the worker,
                    # model, privacy plan): seconds, against minutes for an epoch
                    epoch_s.append(now - last_epoch_at[name])
                    epochs[name], last_epoch_at[name] = epoch, now
                    if not console.is_terminal:  # no live bar in a log file: a line instead
                        console.print(running_status(), highlight=False)
                for ref in ready:
                    finish(ref)
                now = time.monotonic()
                for ref, (*_, started) in list(in_flight.items()):
                    if now - started > pipeline.run_timeout_s:
                        ray.cancel(ref, force=True)
                        finish(ref, f"cancelled after run_timeout_s={pipeline.run_timeout_s:g} s")
        except KeyboardInterrupt:
            for ref in list(in_flight):
                ray.cancel(ref, force=True)
                finish(
                    ref,
                    "interrupted; --resume continues it from its last finished epoch",
                    status="KILLED",
                )
            raise
        finally:
            epochs_done.shutdown()


def report_benchmark(
    pipeline: BenchmarkPipeline, tracker: Tracker, parent: str, failed: dict[str, str]
) -> tuple[Report, list[Path]]:
    """Build the report from every completed child in MLflow (this invocation's and earlier
    ones'), write it under ``<directory>/report`` and log it on the parent run; completed
    runs that lack the pipeline's shift scores get them from their stored weights first."""
    score_stored_weights_under_shift(pipeline, tracker, parent)
    score_weight_noise_averaging(pipeline, tracker, parent)
    records = load_records(tracker, parent)
    specs = {spec.key: spec for spec in pipeline.runs}
    for record in records:  # runs logged before both epsilons were tags get them here
        spec = specs.get(run_key(record.method, record.epsilon, record.replicate))
        if spec is not None:
            tracker.set_tags(record.run_id, epsilon_tags(spec.config, record.metrics))
    configs = {}
    for spec in pipeline.runs:
        configs.setdefault(
            spec.method,
            {
                **spec.config.flat(),
                "tuned_by": spec.tuned_by,
                "space_dimension": spec.space_dimension,
            },
        )
    tuning_scores = {
        (spec.method, spec.epsilon): spec.tuning_score
        for spec in pipeline.runs
        if spec.tuning_score is not None
    }
    touched = {
        (spec.method, spec.epsilon): tuning_touched(tuning, spec.config.data)
        for spec in pipeline.runs
        if (tuning := spec.config.privacy.tuning) is not None
    }
    data = pipeline.data
    subset = f", {data.per_class} per class" if data.per_class else ""
    settings = [
        f"data: {data.dataset} ({data.train_size} training images{subset}, "
        f"{data.val_size} validation, the full test set), split seed "
        f"{pipeline.split_seed}",
        f"model {pipeline.model.name}, {pipeline.epochs} epochs, delta {pipeline.delta:g}, "
        f"accountant {pipeline.accountant}",
        f"seeds {pipeline.seeds}; {len(records)} of {len(pipeline.runs)} runs completed",
        f"MLflow: experiment `{tracker.experiment_name}`, parent run `{parent}`",
        f"noise: {noise_statement(pipeline.research_mode)}",
    ]
    report = build_report(
        f"Benchmark {pipeline.name}",
        records,
        method_order=pipeline.method_names,
        settings=settings,
        method_configs=configs,
        sweeps=pipeline.sweep_directories,
        failed=failed,
        tuning_scores=tuning_scores,
        tuning_touched=touched,
    )
    if records:
        add_shift_blocks(
            report,
            records,
            pipeline.method_names,
            pipeline.references,
            SHIFT_SETS.get(pipeline.shift),
        )
        add_attribution_blocks(report, pipeline.method_names, pipeline.frozen_curvature_arms)
    storage = pipeline.storage
    with tempfile.TemporaryDirectory(prefix="dpivon-report-") as tmp:
        local = Path(tmp)  # the files are made here, then stored and logged
        files = write_report(report, local / REPORT_DIR)
        stored = [path.relative_to(local).as_posix() for path in files]
        for path, name in zip(files, stored, strict=True):
            storage.write_bytes(name, path.read_bytes())
        log_report(tracker, parent, report, files)
    return report, [storage.location(name) for name in stored]


def run_benchmark(
    pipeline: BenchmarkPipeline,
    *,
    address: str | None = None,
    tracking_uri: str | None = None,
    resume: bool = False,
    report_only: bool = False,
) -> BenchmarkOutcome:
    """Run (or resume) every run of the benchmark, then report on all completed runs.

    Runs that fail are recorded (FAILED child, error tag) and left out of the report; the
    parent still ends FINISHED, with ``failed_runs`` saying how many, so that ``--resume``
    can complete it later. ``report_only``: train nothing, report on the runs completed so
    far (an interrupted benchmark's, whose parent keeps its status).
    """
    if not report_only:
        check_fits_here(pipeline.resources, address, "run")
    pipeline.storage.check_writable()
    # one driver per folder, --resume and --report-only (which writes the report) too: a
    # second one is refused before MLflow and Ray
    with FolderLock(pipeline.storage, f"benchmark {pipeline.name!r}"):
        return _run_holding_folder(pipeline, address, tracking_uri, resume, report_only)


def _run_holding_folder(
    pipeline: BenchmarkPipeline,
    address: str | None,
    tracking_uri: str | None,
    resume: bool,
    report_only: bool,
) -> BenchmarkOutcome:
    """:func:`run_benchmark` once its folder is this driver's."""
    uri = tracking_uri or pipeline.tracking_uri
    if report_only:
        return _report_only(pipeline, _tracker_of_started(pipeline, uri))
    if resume:
        _check_run_checkpoints(pipeline)
        if BenchmarkState.exists(pipeline.storage):
            _tracker_of_started(pipeline, uri)  # its parent run is there: before Ray
    # every run shares data fields and split; a missing data path fails before Ray and MLflow
    data = load_data(pipeline.runs[0].config)
    connect(address, pipeline.resources, "run")  # a cluster no run fits: before the store
    # from Ray's start on, whose own SIGTERM handler would abort the driver
    with signals_interrupt():
        tracker = Tracker(uri, pipeline.experiment)
        return _run_and_report(pipeline, tracker, resume, data)


def _tracker_of_started(pipeline: BenchmarkPipeline, uri: str) -> Tracker:
    """The store of a benchmark that has started, checked to hold its parent run (a store
    that does not exist is not created)."""
    storage = pipeline.storage
    if not BenchmarkState.exists(storage):
        raise DpivonError(
            f"benchmark {pipeline.name!r} has not started in {storage.uri}: nothing to report; "
            "run it without --report-only"
        )
    parent = BenchmarkState.load(storage).parent_run_id
    where = f"benchmark {pipeline.name!r} keeps its parent run {parent} in the store it ran with"
    check_store_exists(uri, f"{where}: give that --tracking-uri")
    tracker = Tracker(uri, pipeline.experiment)
    if not tracker.has_run(parent):
        raise DpivonError(
            f"the tracking store {tracker.display_uri} has no run {parent}; {where}: give that "
            "--tracking-uri"
        )
    return tracker


def _run_and_report(
    pipeline: BenchmarkPipeline, tracker: Tracker, resume: bool, data: DataSplits
) -> BenchmarkOutcome:
    """The benchmark's phases once its cluster is up: its parent run, the runs still to do,
    the report; the parent ends FINISHED, KILLED (interrupted) or FAILED."""
    parent = _start_or_resume(pipeline, tracker, resume)
    existing = tracker.child_runs_by_tag(parent, KEY_TAG)
    todo = _pending_runs(pipeline, existing)
    outcome = BenchmarkOutcome(parent, tracker, skipped=len(pipeline.runs) - len(todo))
    console.print(
        f"benchmark {pipeline.name!r}: MLflow {tracker.display_uri}, experiment "
        f"{tracker.experiment_name!r}, parent run {parent}; {len(todo)} of "
        f"{len(pipeline.runs)} runs to do ({outcome.skipped} finished before)"
    )
    try:
        if todo:
            execute_runs(pipeline, tracker, parent, todo, existing, data, outcome)
        outcome.report, outcome.report_files = report_benchmark(
            pipeline, tracker, parent, outcome.failed
        )
    except KeyboardInterrupt:
        tracker.end_run(parent, "KILLED")
        raise
    except BaseException as err:
        tracker.set_tags(parent, {ERROR_TAG: f"{type(err).__name__}: {err}"[:ERROR_LIMIT]})
        tracker.end_run(parent, "FAILED")
        raise
    tracker.set_tags(parent, {"failed_runs": str(len(outcome.failed))})
    tracker.end_run(parent, "FINISHED")
    return outcome


def _check_run_checkpoints(pipeline: BenchmarkPipeline) -> None:
    """Every run checkpoint a resume would continue from reads back as one (a damaged file
    is named before MLflow or Ray starts, not when its run's turn comes)."""
    for spec in pipeline.runs:
        CheckpointPlace.of(pipeline.storage, spec).load()


def _report_only(pipeline: BenchmarkPipeline, tracker: Tracker) -> BenchmarkOutcome:
    parent = BenchmarkState.load(pipeline.storage).parent_run_id
    existing = tracker.child_runs_by_tag(parent, KEY_TAG)
    done = sum(is_completed(existing[s.key]) for s in pipeline.runs if s.key in existing)
    if done == 0:
        raise DpivonError(
            f"benchmark {pipeline.name!r} has no completed run yet: nothing to report"
        )
    outcome = BenchmarkOutcome(parent, tracker, skipped=done)
    console.print(
        f"benchmark {pipeline.name!r}: the report of {done} of {len(pipeline.runs)} runs "
        f"(MLflow {tracker.display_uri}, parent run {parent}); nothing is trained"
    )
    outcome.report, outcome.report_files = report_benchmark(pipeline, tracker, parent, {})
    return outcome
