"""One Ray Tune trial: the same `train` as `dpivon train`, reporting each epoch to Tune.

Runs inside Ray workers and never touches MLflow (the driver is the only writer). Each
epoch's report carries a checkpoint to resume from; the last one carries the trained model
(mean + posterior) that the driver evaluates on the test set if the trial is on the front.
A trial whose parameters turn NaN or infinite ends with a last report flagged ``DIVERGED``
(objectives NaN) instead of an error: a retry from its checkpoint would diverge again.
Every report carries the trial's whole config (``TRIAL_CONFIG``): the driver logs it as the
run's params rather than building it a second time. An epoch's checkpoint is the one
`RunCheckpoint` of every run, which holds no noise key: a trial resumed from it draws under
a fresh key.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import tune

from dpivon.config import TrainConfig, parse_config
from dpivon.data import DataSplits
from dpivon.evaluation.shift import validation_shift_scores
from dpivon.runs import (
    EpochReport,
    RunCheckpoint,
    TrainingDiverged,
    released_metrics,
    train,
)
from dpivon.search.pipeline import METRIC_MODES
from dpivon.search.space import SearchSpace
from dpivon.tracking.model_file import save_model_file

RESUME_FILE = "resume.pt"
MODEL_FILE = "model.pt"
FINAL_RESULT_FILE = "result.json"  # beside the model: what a restored final trial reports
COMPLETE = "training_complete"
DIVERGED = "diverged"  # 1 in the last report of a trial whose parameters became non-finite
DIVERGED_ERROR = "diverged_error"  # its message (a string: no MLflow metric)
GROUP_KEY = "dpivon_group"  # the group a trial's config belongs to (not a search parameter)
TRIAL_CONFIG = "trial_config"  # the trial's TrainConfig as flat keys, JSON (not a metric)
REPLAYED = "replayed"  # 1 in a final result said again: MLflow has it already


class TrialAlreadyFailed(RuntimeError):
    """A resumed trial whose MLflow run already records its failure."""


@dataclass(frozen=True)
class RecordedOutcome:
    """A trial's outcome as its MLflow run already holds it.

    Tune's saved state can lag that record by a second or more, so after a lost driver a
    resume may start a trial that had ended. It then repeats this outcome to Tune and
    trains nothing: no trial is trained twice, and a final checkpoint (which holds no
    resume state) is never resumed from.
    """

    result: dict[str, float | str]  # its last metrics (the objectives among them), its error
    failed: bool  # it ended in an error (not a divergence)

    def report_again(self) -> None:
        if self.failed:
            raise TrialAlreadyFailed(
                "this trial failed before the driver was lost (its MLflow run has the "
                "error); a resume does not run it again"
            )
        tune.report(self.result)


def trial_seed(pipeline_seed: int, trial_id: str) -> int:
    """The training seed of one trial: distinct per trial, stable across resumes.

    Trials must not share DP noise: two released models with equal noise and different
    clip norms let an observer cancel it (g1/C1 - g2/C2 is noise-free), and composition
    assumes independent trials.
    """
    digest = hashlib.blake2b(f"{pipeline_seed}:{trial_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")  # in [0, 2**32): what numpy's seed accepts


def trial_train_config(
    base_config: dict[str, Any], space: SearchSpace, params: dict[str, Any], trial_id: str
) -> TrainConfig:
    """A trial's full TrainConfig: the pipeline's settings, the sampled ones, its own seed."""
    seed = trial_seed(base_config["data_seed"], trial_id)
    return parse_config(
        {**base_config, **space.trial_config(params), "seed": seed}, source="trial config"
    )


def _privacy_facts(summary: dict[str, Any]) -> dict[str, Any]:
    keys = ("noise_multiplier", "sample_rate", "steps", "epsilon_spent", "target_epsilon")
    return {k: summary.get(k) for k in keys}


def run_trial(
    params: dict[str, Any],
    *,
    data: DataSplits,
    base_config: dict[str, Any],
    space: SearchSpace,
    shift_severity: int | None = None,
) -> None:
    """Ray Tune function trainable: ``params`` is what OptunaSearch drew; with
    ``shift_severity`` every epoch also reports the ``val_shift_*`` objectives."""
    config = trial_train_config(base_config, space, params, tune.get_context().get_trial_id())
    # in every report, so that the driver has it whichever report it sees first
    node = {
        "node_id": ray.get_runtime_context().get_node_id(),
        TRIAL_CONFIG: json.dumps(config.flat()),
    }

    resume_state = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            final = Path(directory) / FINAL_RESULT_FILE
            if final.exists():
                # Restored from its final checkpoint (a driver lost before Tune saw the
                # trial end): it has trained; it says its result again.
                tune.report({**json.loads(final.read_text()), REPLAYED: 1})
                return
            # read, not load: a folder with neither file is an error, not a fresh start
            path = Path(directory) / RESUME_FILE
            resume_state = RunCheckpoint.read(path).check_config(config, path).training

    reported = {"epoch": resume_state["epoch"] if resume_state else 0}  # last epoch done

    def report_epoch(report: EpochReport) -> None:
        reported["epoch"] = report.epoch
        if report.epoch == config.training.epochs:
            return  # the final report below carries the model instead
        with tempfile.TemporaryDirectory() as directory:
            # Without the noise key: the folder may be copied or committed, and a resumed
            # trial continues under a fresh key (independent noise is still DP).
            RunCheckpoint.after_epoch(config, report).save(Path(directory) / RESUME_FILE)
            tune.report(
                {**released_metrics(config, report.metrics), COMPLETE: 0, **node},
                checkpoint=tune.Checkpoint.from_directory(directory),
            )

    try:
        result = train(
            config,
            data=data,
            on_epoch_end=report_epoch,
            resume_state=resume_state,
            evaluate_test=False,
            extra_validation=(
                validation_shift_scores(config, data.val_images, shift_severity)
                if shift_severity is not None
                else None
            ),
        )
    except TrainingDiverged as err:
        # Tune checks that every result holds the objectives; NaN keeps them out of
        # ASHA's rungs (nan-aware) and of Optuna (an incomplete trial is not told values).
        nan_objectives = dict.fromkeys(METRIC_MODES, math.nan)
        tune.report(
            {
                **nan_objectives,
                "epoch": reported["epoch"] + 1,
                COMPLETE: 0,
                DIVERGED: 1,
                DIVERGED_ERROR: str(err),
                **err.privacy,  # what it spent: the tuning cost counts it
                **node,
            }
        )
        return
    final_metrics = {
        **released_metrics(config, result.history[-1]),
        **_privacy_facts(result.summary()),
        COMPLETE: 1,
        "wall_time_s": result.wall_time_s,
        **node,
    }
    with tempfile.TemporaryDirectory() as directory:
        save_model_file(Path(directory) / MODEL_FILE, config, result.model, result.posterior)
        (Path(directory) / FINAL_RESULT_FILE).write_text(json.dumps(final_metrics))
        tune.report(final_metrics, checkpoint=tune.Checkpoint.from_directory(directory))
