"""How dpivon's runs sit in MLflow, shared by every driver that writes them and every reader:
the run kinds, the tags all kinds share, and one outcome vocabulary.

A sweep trial keeps its outcome in ``dpivon.trial_status`` and a benchmark run in
``dpivon.run_status`` (stores written before this module read back unchanged); both hold
a `RunOutcome`.
"""

from __future__ import annotations

from enum import StrEnum

KIND_TAG = "dpivon.kind"
OPTIMIZER_TAG = "dpivon.optimizer"
# A run's two epsilons, the same names on every run kind that trains. EPSILON_TAG: its
# training's, the budget it was calibrated to (it spends at most that) or, for a sweep
# trial, what it spends (a noise-faithful trial far more than its group's budget); never
# less than the run spent. END_TO_END_EPSILON_TAG, on a finished train or benchmark run and
# a sweep's released model: that training composed (RDP) with the tuning that chose its
# settings on the same records, what the released model costs; the training's own for
# settings fixed without those records.
EPSILON_TAG = "dpivon.epsilon"
END_TO_END_EPSILON_TAG = "dpivon.epsilon_end_to_end"
ERROR_TAG = "error"  # a failed run's error, one line
ERROR_LIMIT = 5000  # characters of an error kept in its tag


class RunKind(StrEnum):
    """What a parent or stand-alone run is: its ``dpivon.kind`` tag."""

    TRAIN = "train"
    AUDIT = "audit"
    SWEEP = "sweep"
    BENCHMARK = "benchmark"
    BENCHMARK_RUN = "benchmark-run"


class RunOutcome(StrEnum):
    """What became of a run."""

    RUNNING = "running"  # in flight, or interrupted with its driver (a resume finishes it)
    COMPLETED = "completed"  # trained every epoch and fully logged
    EARLY_STOPPED = "early_stopped"  # a sweep trial stopped by ASHA on a shorter run
    DIVERGED = "diverged"  # training produced non-finite values
    FAILED = "failed"
