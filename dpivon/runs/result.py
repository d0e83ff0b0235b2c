"""What a run hands on: a step's progress, a finished epoch, its result (and its epsilon's
meaning), or the divergence that ended it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from dpivon.config import DataConfig, TrainConfig, TuningCost
from dpivon.errors import DpivonError
from dpivon.evaluation import Posterior
from dpivon.evaluation.metrics import ReliabilityDiagram, json_number
from dpivon.privacy.engine import PrivacyPlan
from dpivon.privacy.noise import RESEARCH_MODE_WARNING
from dpivon.privacy.tuning import TrialMechanism, compose_with_tuning
from dpivon.runs.phases import PhaseTimes


class TrainingDiverged(DpivonError):
    """The parameters became NaN or infinite. ``privacy`` holds the mechanism of the planned run
    (noise_multiplier, sample_rate, steps: all of it, the conservative count) for private
    runs: a diverged trial spent budget too, and the tuning cost must count it."""

    def __init__(self, message: str, privacy: dict[str, float] | None = None):
        super().__init__(message)
        self.privacy = privacy or {}


@dataclass(frozen=True)
class StepReport:
    """What a progress display sees after each training step."""

    task: str
    done: int  # steps so far, of `total`
    total: int
    status: str


StepCallback = Callable[[StepReport], None]


@dataclass
class EpochReport:
    """What callbacks see after each epoch; ``checkpoint()`` builds resumable state lazily."""

    epoch: int
    metrics: dict[str, float]
    checkpoint: Callable[[], dict]


@dataclass
class TrainResult:
    config: TrainConfig
    privacy: PrivacyPlan | None
    epsilon_spent: float | None
    steps: int
    train_images: int  # the records the run trained on (the accountant's dataset size)
    history: list[dict[str, float]]
    val: dict[str, float]
    test: dict[str, float] | None
    test_reliability: ReliabilityDiagram | None
    model: nn.Module
    posterior: Posterior | None
    wall_time_s: float
    extra: dict[str, float] = field(default_factory=dict)
    # every set scored under shift (`dpivon.evaluation.shift.ShiftResult.record`: rows, images,
    # seconds), where the run was; its means per severity are in ``test`` as shift_s<k>_*
    shift_record: dict[str, Any] | None = None
    engine: str | None = None  # the clipping engine ``auto`` resolved to (private runs)
    phases: PhaseTimes = field(default_factory=PhaseTimes)

    def summary(self) -> dict[str, float | int | str | None]:
        """Flat, JSON-ready record of the run (the ``--json`` output)."""
        c, plan = self.config, self.privacy
        out: dict[str, float | int | str | None] = {
            "optimizer": c.optimizer.name,
            "model": c.model.name,
            "dataset": c.data.dataset,
            "epochs": c.training.epochs,
            "lr": c.optimizer.lr,
            "target_epsilon": plan.target_epsilon if plan else None,
            "epsilon_spent": self.epsilon_spent,
            "delta": c.privacy.delta if plan else None,
            "accountant": plan.accountant if plan else None,
            "noise_multiplier": plan.noise_multiplier if plan else 0.0,
            "sample_rate": plan.sample_rate if plan else None,
            "steps": self.steps,
            "train_images": self.train_images,
            "max_grad_norm": c.privacy.max_grad_norm if plan else None,
            "engine": self.engine,
            "batch_size": c.training.batch_size,
            "wall_time_s": self.wall_time_s,
        }
        out.update(self.tuning_summary())
        out.update(self.curvature_summary())
        out.update({f"val_{k}": v for k, v in self.val.items()})
        if self.test is not None:
            out.update({f"test_{k}": v for k, v in self.test.items()})
        out.update(self.extra)
        return {k: json_number(v) for k, v in out.items()}

    def curvature_summary(self) -> dict[str, float]:
        """An IVON-family run's curvature at its last epoch: the share of h its horizon let
        the estimates make (``curvature_horizon_share``), the share they made
        (``curvature_learned_share_median``, ``_q10``, ``_q90``) and the share of a step
        that came from it (``curvature_update_share``); empty for other runs."""
        last = self.history[-1] if self.history else {}
        return {k: v for k, v in last.items() if k.startswith("curvature_")}

    def tuning_summary(self) -> dict[str, float | str]:
        """What this run's epsilon covers; for a config chosen by a sweep also the tuning
        epsilon and its composition with this run, which covers the released model (both
        used the same records)."""
        tuning, plan = self.config.privacy.tuning, self.privacy
        if plan is None:
            return {}
        if self.config.privacy.research_mode:
            return {"epsilon_covers": f"nothing: {RESEARCH_MODE_WARNING}"}
        if tuning is None:
            validation = (
                "validation scores are noised (validation records covered too)"
                if self.config.evaluation.val_noise_multiplier > 0
                else "the validation scores are exact (validation records unprotected)"
            )
            return {
                "epsilon_covers": (
                    "epsilon_spent covers the model (mean and posterior) and the DP "
                    "diagnostics of this run for the training records (add or remove one), "
                    "if its hyper-parameters were chosen without those records; the training "
                    f"loss is not covered and {validation}"
                )
            }
        return {
            "tuning_epsilon": tuning.quoted_epsilon,
            "epsilon_with_tuning": epsilon_with_tuning(plan, self.steps, tuning),
            "epsilon_covers": (
                "epsilon_with_tuning covers the released model, epsilon_spent this training "
                f"alone: {tuning_touched(tuning, self.config.data)}"
            ),
        }


def epsilon_with_tuning(plan: PrivacyPlan, steps: int, tuning: TuningCost) -> float:
    """The end-to-end epsilon of a run of ``steps`` steps of ``plan`` whose settings a sweep
    chose on the same records: its training composed (RDP) with the tuning's quoted cost."""
    production = TrialMechanism(plan.noise_multiplier, plan.sample_rate, steps)
    return compose_with_tuning(production, tuning.quoted_rdp, plan.delta)


def tuning_touched(tuning: TuningCost, data: DataConfig) -> str:
    """What the tuning behind a run's settings touched, in one line: the images its trials
    trained on and chose by (the run's own split of ``data``, as the end-to-end epsilon
    assumes), and whether those scores were exact."""
    return (
        f"tuned by sweep {tuning.sweep} ({tuning.release} release) on the "
        f"same {data.train_size:,} training images, chosen by its scores on the "
        f"{data.val_size:,} validation images; its cost covers {tuning.records_covered}"
    )
