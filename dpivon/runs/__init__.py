"""One training run from its config to its release, shared by every driver: the CLI's
`train`, sweep trials, benchmark runs and the audit.

- `setup`: wiring (data, model, optimizer, Opacus) and the checks before a run opens;
- `loop`: `train` and `TrainingRun`, the one training loop, as named phases;
- `result`: what a run hands on (`StepReport`, `EpochReport`, `TrainResult`);
- `checkpoint`: `RunCheckpoint`, the one resumable-state format;
- `release`: what a run may release; `phases`: where its time goes.
"""

from dpivon.runs.checkpoint import RunCheckpoint
from dpivon.runs.loop import RunOptions, TrainingRun, ValidationScores, train
from dpivon.runs.phases import PHASES, PhaseTimes
from dpivon.runs.release import NOT_COVERED_METRICS, releasable_state, released_metrics
from dpivon.runs.result import (
    EpochReport,
    StepCallback,
    StepReport,
    TrainingDiverged,
    TrainResult,
)
from dpivon.runs.setup import (
    TrainingSetup,
    build_training,
    check_batch,
    check_fits,
    check_plan_reachable,
    frozen_curvature_warning,
    global_generators_restored,
    load_data,
    planned_curvature_share,
    privacy_plan,
    resolve_device,
    seed_everything,
    synthetic_sizes,
    train_step,
)

__all__ = [
    "NOT_COVERED_METRICS", "PHASES", "EpochReport", "PhaseTimes", "RunCheckpoint", "RunOptions",
    "StepCallback", "StepReport", "TrainResult", "TrainingDiverged", "TrainingRun",
    "TrainingSetup", "ValidationScores", "build_training", "check_batch", "check_fits",
    "check_plan_reachable", "frozen_curvature_warning", "global_generators_restored",
    "load_data", "planned_curvature_share", "privacy_plan",
    "releasable_state", "released_metrics", "resolve_device", "seed_everything",
    "synthetic_sizes", "train", "train_step",
]  # fmt: skip
