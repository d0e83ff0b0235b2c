"""One benchmark run, the body of its Ray task: train through `dpivon.runs.train`
(checkpointing every epoch in the benchmark's folder), then test, temperature-scale and
score under shift with train's own evaluation."""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

import ray

from dpivon.config import TrainConfig
from dpivon.data import DataSplits
from dpivon.errors import DpivonError
from dpivon.evaluation import (
    evaluate_as_configured,
)
from dpivon.evaluation.calibration import apply_temperature, fit_temperature
from dpivon.evaluation.metrics import (
    classification_metrics,
    reliability_diagram,
)
from dpivon.evaluation.shift import ShiftSet, evaluate_shift_as_configured
from dpivon.orchestration.storage import ResultsStorage
from dpivon.process import enter_ray_worker
from dpivon.runs import (
    EpochReport,
    RunCheckpoint,
    TrainResult,
    train,
)
from dpivon.runs.checkpoint import CHECKPOINT_FIELDS, CHECKPOINT_LAYOUT
from dpivon.saved_files import FORMAT_KEY, read_saved
from dpivon.study.spec import RunSpec

CHECKPOINTS = "checkpoints"  # <storage>/checkpoints/<run>.pt: the runs in progress
# The benchmark's checkpoint before every driver shared one format
BENCHMARK_LAYOUT_1 = {"config_hash": str, "training": dict, "seconds": (int, float)}


def config_hash(spec: RunSpec) -> str:
    return hashlib.sha256(spec.config_json.encode()).hexdigest()[:16]


def score_on_test(
    result: TrainResult, data: DataSplits, shift_set: ShiftSet | None = None
) -> TrainResult:
    """The run's test metrics and reliability, and post-hoc temperature scaling: T fitted on
    the validation predictive (exact scores of the validation records, as the sweep uses
    them), applied to the test predictive (accuracy is unchanged by T).

    Scaling needs the predictive probabilities, which `train` does not return, so the test
    set is evaluated here, once, with `train`'s own evaluation
    (`dpivon.evaluation.evaluate_as_configured`: the run's BMA samples, bins and seed, the
    same numbers `evaluate_test=True` gives);
    evaluating it twice would double the cost of a run (BMA over the whole test set).
    With ``shift_set`` the test metrics gain ``shift_s<k>_*``: the predictive on that set's
    clean and corrupted test images (`dpivon.evaluation.shift`).
    """
    config = result.config

    def predictive(split):
        return evaluate_as_configured(config, result.model, split, result.posterior)

    val, test = predictive(data.val), predictive(data.test)
    extra = dict(result.extra)
    temperature = fit_temperature(val.probs, val.labels)
    if temperature is not None:  # else the validation split does not determine one
        tempered = classification_metrics(
            apply_temperature(test.probs, temperature), test.labels, config.evaluation.ece_bins
        )
        extra["temperature"] = temperature
        extra.update({f"test_ts_{k}": v for k, v in tempered.items() if k != "accuracy"})
    diagram = reliability_diagram(test.probs, test.labels, config.evaluation.ece_bins)
    metrics, shift_record = dict(test.metrics), None
    if shift_set is not None:
        shifted = evaluate_shift_as_configured(
            config, result.model, result.posterior, data.test_images, shift_set
        )
        metrics.update(shifted.by_severity())
        shift_record = shifted.record()
    return replace(
        result, test=metrics, test_reliability=diagram, extra=extra, shift_record=shift_record
    )


class EpochSink(Protocol):
    """Where a run reports its finished epochs: a Ray queue (or any queue)."""

    def put_nowait(self, item: tuple[str, int]) -> None: ...


@dataclass(frozen=True)
class CheckpointPlace:
    """Where one benchmark run keeps its `RunCheckpoint`, rewritten after every epoch in the
    benchmark's folder: `--resume` continues an interrupted run from it, in a later session
    too, since the folder may be kept (and published) with the results, which the
    checkpoint's releasable state allows. Deleted once the run's result is logged."""

    folder: ResultsStorage  # <storage>/checkpoints, by its absolute location
    name: str
    config: TrainConfig
    config_hash: str  # what a checkpoint of layout 1 names its configuration by

    @classmethod
    def of(cls, storage: ResultsStorage, spec: RunSpec) -> CheckpointPlace:
        # "." is in no method name: distinct keys give distinct files
        name = re.sub(r"[^A-Za-z0-9_.-]", ".", spec.key) + ".pt"
        folder = ResultsStorage.at(storage.location(CHECKPOINTS))
        return cls(folder, name, spec.config, config_hash(spec))

    def load(self) -> RunCheckpoint | None:
        """The run's checkpoint, or None when it has none; one the benchmark wrote before
        every driver shared one format (layout 1: releasable already, its configuration
        named by a hash) reads as one of today's."""
        if not self.folder.exists(self.name):
            return None
        where = self.folder.location(self.name)
        layouts = {1: [BENCHMARK_LAYOUT_1], CHECKPOINT_LAYOUT: [CHECKPOINT_FIELDS]}
        saved = read_saved(self.folder.read_bytes(self.name), "checkpoint", layouts, where)
        if saved[FORMAT_KEY] == CHECKPOINT_LAYOUT:
            return RunCheckpoint.from_saved(saved, where).check_config(self.config, where)
        if saved["config_hash"] != self.config_hash:
            raise DpivonError(
                f"checkpoint {where} is of another run configuration; delete it (the run "
                "then starts from its first epoch)"
            )
        layout_2 = {**saved, FORMAT_KEY: CHECKPOINT_LAYOUT, "config": self.config.flat(),
                    "mlflow_run_id": ""}  # fmt: skip
        return RunCheckpoint.from_saved(layout_2, where)

    def save(self, checkpoint: RunCheckpoint) -> None:
        self.folder.write_bytes(self.name, checkpoint.to_bytes())

    def remove(self) -> None:
        self.folder.remove(self.name)


def run_in_worker(threads: int, *args: Any) -> TrainResult:
    """The Ray task: ``run_one(*args)`` in a worker that it sets up first, ``threads`` being
    its CPU share."""
    enter_ray_worker(threads)
    return run_one(*args)


def run_one(
    config: TrainConfig,
    data: DataSplits,
    place: CheckpointPlace,
    resume: RunCheckpoint | None = None,
    epochs_done: EpochSink | None = None,
    shift_set: ShiftSet | None = None,
) -> TrainResult:
    """One benchmark run (the Ray task's body): train (from ``resume``, checkpointing every
    epoch), test, temperature-scale, score under ``shift_set`` (the pipeline's ``shift``); the model
    returns on the CPU, its wall time summed over attempts.
    After each checkpoint, ``(checkpoint name, epoch)`` goes to ``epochs_done`` (a queue:
    the driver's progress line)."""
    earlier_s = resume.seconds if resume is not None else 0.0
    started = time.perf_counter()

    def save(report: EpochReport) -> None:
        seconds = earlier_s + time.perf_counter() - started
        place.save(RunCheckpoint.after_epoch(config, report, seconds=seconds))
        if epochs_done is not None:  # progress only: a lost queue fails no run
            with contextlib.suppress(ray.exceptions.RayError):
                epochs_done.put_nowait((place.name, report.epoch))

    result = train(
        config,
        data=data,
        evaluate_test=False,
        on_epoch_end=save,
        resume_state=resume.training if resume is not None else None,
    )
    scored = score_on_test(result, data, shift_set)
    return replace(scored, wall_time_s=earlier_s + time.perf_counter() - started)
