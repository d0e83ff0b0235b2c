"""A run's resumable state: what it is made of (model, optimizer, schedule, accountant,
every random stream, the history), and the one file format that `dpivon train
--checkpoint`, sweep trials and benchmark runs all write and read back.

The file is releasable like the model (`releasable_state`): no noise key, since a resumed
secure run draws under a fresh one, and no metric the run's epsilon does not cover. It is
versioned and checked where it is read: a damaged, foreign, older or other run's file gets
one line naming the file before any run is opened.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dpivon.config import TrainConfig
from dpivon.errors import DpivonError, first_line
from dpivon.privacy.sampling import ShuffledBatches
from dpivon.runs.release import releasable_state
from dpivon.runs.result import EpochReport
from dpivon.runs.setup import TrainingSetup
from dpivon.saved_files import FORMAT_KEY, read_saved, versioned

# Layout 1 was a file per driver; layout 2 is the one of every driver.
CHECKPOINT_LAYOUT = 2
CHECKPOINT_FIELDS = {"config": dict, "training": dict, "mlflow_run_id": str,
                     "seconds": (int, float)}  # fmt: skip
# What `training_state` holds, each of its type
TRAINING_STATE = {"epoch": int, "model": dict, "optimizer": dict, "scheduler": dict,
                  "accountant": (dict, type(None)), "rng": dict, "history": list}  # fmt: skip
# Layout 1, a file per driver: `dpivon train --checkpoint`'s (its whole state, the noise key
# included) and a sweep trial's (the releasable state alone; its config is the trial's)
TRAIN_LAYOUT_1 = {"config": dict, "mlflow_run_id": str, "training": dict}
TRIAL_LAYOUT_1 = TRAINING_STATE


def rng_states(setup: TrainingSetup) -> dict:
    """Every random stream a run draws from: resuming continues each instead of replaying."""
    states = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "randomness": setup.randomness.state_dict(),
    }
    if isinstance(setup.loader, ShuffledBatches):
        states["shuffling"] = setup.loader.generator.get_state()
    return states


def restore_rng_states(states: dict, setup: TrainingSetup) -> None:
    if "randomness" not in states:
        raise DpivonError(
            "this checkpoint predates secure noise (it holds a seeded generator, no noise "
            "key): it cannot resume; start the run again"
        )
    torch.set_rng_state(states["torch"])
    if states["cuda"]:
        torch.cuda.set_rng_state_all(states["cuda"])
    setup.randomness.load_state_dict(states["randomness"])
    if isinstance(setup.loader, ShuffledBatches):
        setup.loader.generator.set_state(states["shuffling"])


def training_state(epoch: int, setup: TrainingSetup, scheduler: Any, history: list[dict]) -> dict:
    """The whole state after ``epoch`` (the noise key included: `releasable_state` drops it)."""
    return {
        "epoch": epoch,
        "model": setup.model.state_dict(),
        "optimizer": setup.optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "accountant": setup.private.accountant.state_dict() if setup.private else None,
        "rng": rng_states(setup),
        "history": list(history),
    }


def restore_training_state(state: dict, setup: TrainingSetup, scheduler: Any) -> tuple[int, list]:
    """Load ``state`` into a freshly built run; its last epoch and history."""
    setup.model.load_state_dict(state["model"])
    setup.optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if setup.private is not None:
        setup.private.accountant.load_state_dict(state["accountant"])
    restore_rng_states(state["rng"], setup)
    return state["epoch"], list(state["history"])


@dataclass(frozen=True)
class RunCheckpoint:
    """One run after its last finished epoch: the config it belongs to (flat keys), its
    releasable training state and the two facts a driver keeps beside it: the MLflow run it
    reports to (`dpivon train`) and the seconds its attempts trained (benchmark runs)."""

    config: dict[str, Any]
    training: dict[str, Any]
    mlflow_run_id: str = ""
    seconds: float = 0.0

    @classmethod
    def after_epoch(
        cls, config: TrainConfig, report: EpochReport, *, mlflow_run_id: str = "",
        seconds: float = 0.0,
    ) -> RunCheckpoint:  # fmt: skip
        state = releasable_state(config, report.checkpoint())
        return cls(config.flat(), state, mlflow_run_id, seconds)

    @property
    def epoch(self) -> int:
        return int(self.training["epoch"])

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        payload = {
            "config": self.config, "training": self.training,
            "mlflow_run_id": self.mlflow_run_id, "seconds": float(self.seconds),
        }  # fmt: skip
        torch.save(versioned(payload, CHECKPOINT_LAYOUT), buffer)
        return buffer.getvalue()

    @classmethod
    def read(cls, source: Path | bytes, where: str | Path | None = None) -> RunCheckpoint:
        """The checkpoint in ``source`` (a path, or the bytes of the file at ``where``),
        whatever its run: one line naming the file if it is not a dpivon checkpoint. Files
        of layout 1 read as this one: train's made releasable, a trial's without a config
        (`check_config` adopts the run's)."""
        layouts = {1: [TRAIN_LAYOUT_1, TRIAL_LAYOUT_1], CHECKPOINT_LAYOUT: [CHECKPOINT_FIELDS]}
        return cls.from_saved(read_saved(source, "checkpoint", layouts, where), where or source)

    @classmethod
    def from_saved(cls, saved: dict[str, Any], where: str | Path) -> RunCheckpoint:
        """The checkpoint of a file's dict (`read_saved`, of layout 2 or one of layout 1)."""
        if saved[FORMAT_KEY] == 1 and "training" not in saved:  # a trial's layout 1
            state = {k: v for k, v in saved.items() if k != FORMAT_KEY}
            saved = {FORMAT_KEY: 1, "config": {}, "training": state, "mlflow_run_id": "",
                     "seconds": 0.0}  # fmt: skip
        training = saved["training"]
        wrong = [
            k
            for k, kind in TRAINING_STATE.items()
            if not isinstance(training.get(k), kind) or isinstance(training.get(k), bool)
        ]
        rng = training.get("rng")
        if wrong or not isinstance(rng.get("randomness"), dict):
            raise DpivonError(
                f"checkpoint {where} lacks the training state's "
                f"{', '.join(wrong or ['rng randomness'])} or holds another type there, so it "
                "is not a dpivon checkpoint that can resume; delete it or name another file"
            )
        if saved[FORMAT_KEY] == CHECKPOINT_LAYOUT or not saved["config"]:
            return cls(saved["config"], training, saved["mlflow_run_id"],
                       float(saved["seconds"]))  # fmt: skip
        try:  # train's layout 1 held the noise key: the state is made releasable here
            config = TrainConfig.model_validate(saved["config"])
        except ValueError as err:
            raise DpivonError(
                f"checkpoint {where} holds no valid configuration ({first_line(err)})"
            ) from None
        return cls(saved["config"], releasable_state(config, training), saved["mlflow_run_id"])

    def check_config(self, config: TrainConfig, where: str | Path) -> RunCheckpoint:
        """This checkpoint, if it is ``config``'s (one that names no configuration, a
        trial's of layout 1, takes ``config``)."""
        if not self.config:
            return replace(self, config=config.flat())
        if self.config != config.flat():
            raise DpivonError(
                f"checkpoint {where} is of another run configuration; delete it: the run "
                "then starts from its first epoch"
            )
        return self

    @classmethod
    def load(cls, path: Path, config: TrainConfig) -> RunCheckpoint | None:
        """``config``'s checkpoint at ``path`` (as `read`); None where no file is."""
        if not os.path.lexists(path):  # a FIFO or a symlink loop is refused, not opened
            return None
        return cls.read(path).check_config(config, path)

    def save(self, path: Path) -> None:
        """Write it to ``path`` whole: an interrupted save leaves the previous epoch's."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".tmp")
        partial.write_bytes(self.to_bytes())
        partial.replace(path)
