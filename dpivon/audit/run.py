"""`dpivon audit`: the run as audited (the one training loop with the canaries in) and its
noise-off control, the checks before them and the result."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np

from dpivon.audit.bound import audit_scores, clt_mu, gaussian_mu, gdp_epsilon
from dpivon.audit.canaries import (
    CANARY_NORM_IN_CLIPS,
    Canaries,
    CanaryExamples,
    check_auditable_engine,
    check_canary_count,
    last_linear,
)
from dpivon.config import PRIVATE_OPTIMIZERS, TrainConfig, parse_config
from dpivon.data import DataSplits
from dpivon.errors import DpivonError
from dpivon.models import build_model
from dpivon.privacy.accounting import epsilon_spent
from dpivon.privacy.engine import PrivacyPlan
from dpivon.runs import (
    PhaseTimes,
    RunOptions,
    StepCallback,
    TrainingRun,
    global_generators_restored,
    load_data,
)


@dataclass(frozen=True)
class RunAudit:
    """One scored training run (the real one or the noise-off control)."""

    noise_multiplier: float
    epsilon_lower_bound: float  # Steinke, Nasr & Jagielski's bound
    mu: float  # `gaussian_mu`: the canaries' mean shift in noise stds
    mu_lower_bound: float
    epsilon_certified: float  # the Gaussian analysis: epsilon at delta of mu_lower_bound
    guesses: int
    correct_guesses: int
    k_plus: int
    k_minus: int
    steps: int
    included: int
    mean_times_sampled: float  # per included canary; about q * steps
    measured_noise_multiplier: float  # `CanaryExamples.noise_estimate`


@dataclass(frozen=True)
class AuditResult:
    """Claimed epsilon against what one run, and its noise-off control, certify."""

    optimizer: str
    claimed_epsilon: float
    delta: float
    canaries: int
    confidence: float
    sample_rate: float
    steps: int
    noise_multiplier: float
    claimed_mu: float  # `clt_mu` of the accounted mechanism
    real: RunAudit
    control: RunAudit
    epsilon_at_measured_noise: float  # the accountant's, at the real run's measured noise
    wall_time_s: float

    @property
    def claimed_gdp_epsilon(self) -> float:
        """The claim in the Gaussian analysis' units: epsilon at delta of `claimed_mu`."""
        return gdp_epsilon(self.claimed_mu, self.delta)

    @property
    def noise_ratio(self) -> float:
        """The noise the real run's gradients show over the noise accounted."""
        return self.real.measured_noise_multiplier / self.noise_multiplier

    @property
    def noise_ratio_floor(self) -> float:
        """`noise_ratio` below this is a violation: `NOISE_TOLERANCE` less four standard
        errors of the estimate (1.166 / sqrt(values) for a median absolute deviation)."""
        return NOISE_TOLERANCE - 4 * 1.166 / math.sqrt(self.steps * self.canaries)

    def violations(self) -> list[str]:
        """What this audit refutes, one line each: a Gaussian-DP mu above the claimed one,
        an epsilon lower bound above the claim, or less noise in the released gradients
        than the accountant was told."""
        found = []
        if self.real.mu_lower_bound > self.claimed_mu:
            found.append(
                f"the canaries show Gaussian-DP mu >= {self.real.mu_lower_bound:.3g} (epsilon "
                f"{self.real.epsilon_certified:.3g}) at {self.confidence:.0%} confidence, above"
                f" the claimed mu {self.claimed_mu:.3g} (epsilon {self.claimed_gdp_epsilon:.3g}"
                f"; accountant {self.claimed_epsilon:g})"
            )
        if self.real.epsilon_lower_bound > self.claimed_epsilon:
            found.append(
                f"epsilon >= {self.real.epsilon_lower_bound:.3g} at {self.confidence:.0%} "
                f"confidence, above the claimed {self.claimed_epsilon:g}"
            )
        if self.noise_ratio < self.noise_ratio_floor:
            found.append(
                f"the gradients carry noise multiplier {self.real.measured_noise_multiplier:.3g}"
                f", {self.noise_ratio:.0%} of the {self.noise_multiplier:.3g} accounted "
                f"(epsilon {self.epsilon_at_measured_noise:.3g} at that noise)"
            )
        return found

    def summary(self) -> dict[str, float | int | str]:
        """Flat, JSON-ready record (the ``--json`` output)."""
        out: dict[str, float | int | str] = {
            k: v for k, v in asdict(self).items() if k not in ("real", "control")
        }
        out.update(
            claimed_gdp_epsilon=self.claimed_gdp_epsilon,
            epsilon_certified=self.real.epsilon_certified,
            mu=self.real.mu,
            mu_lower_bound=self.real.mu_lower_bound,
            control_mu_lower_bound=self.control.mu_lower_bound,
            control_epsilon_certified=self.control.epsilon_certified,
            epsilon_lower_bound=self.real.epsilon_lower_bound,
            control_epsilon_lower_bound=self.control.epsilon_lower_bound,
            guesses=self.real.guesses,
            correct_guesses=self.real.correct_guesses,
            control_guesses=self.control.guesses,
            control_correct_guesses=self.control.correct_guesses,
            k_plus=self.real.k_plus,
            k_minus=self.real.k_minus,
            included_canaries=self.real.included,
            mean_times_sampled=self.real.mean_times_sampled,
            measured_noise_multiplier=self.real.measured_noise_multiplier,
            noise_ratio=self.noise_ratio,
        )
        return out


# Measured noise below this share of the accounted (less the estimate's error, see
# `AuditResult.noise_ratio_floor`) is a violation; the data's gradients on the canaries'
# coordinates only add to the measured noise.
NOISE_TOLERANCE = 0.9

# Small enough that an audit (real run + control) takes under a minute on a CPU; 45 steps
# at epsilon 2 with 2,000 canaries: many enough steps for the Gaussian analysis to certify
# about half the claim on a correct run, and a noise-off control far above it (the data's
# own gradient along a canary's direction, and the other canaries', are its only noise).
AUDIT_DEFAULTS: dict[str, object] = dict(
    dataset="synthetic",
    model="small-cnn",
    synthetic_size=500,
    epochs=5,
    batch_size=50,
    epsilon=2.0,
    delta=1e-5,
)


def check_audit(config: TrainConfig, canaries: int, confidence: float) -> None:
    """What an audit needs, checked before any run is opened: a private optimizer, a finite
    epsilon, an engine the canaries can enter, a canary count the last layer can hold
    (`check_canary_count`) and a confidence in (0, 1)."""
    if config.optimizer.name not in PRIVATE_OPTIMIZERS:
        raise DpivonError(
            f"{config.optimizer.name} is not private: audit one of {', '.join(PRIVATE_OPTIMIZERS)}"
        )
    if not math.isfinite(config.privacy.epsilon):
        raise DpivonError("epsilon must be finite: a run without noise claims nothing")
    check_auditable_engine(config.privacy.engine)
    check_canary_count(canaries, last_linear(build_model(config.model.name)))
    if not 0 < confidence < 1:
        raise DpivonError(f"confidence must be in (0, 1), got {confidence}")


def audit_config(**overrides: object) -> TrainConfig:
    """A training config with the audit's defaults under ``overrides``."""
    return parse_config({**AUDIT_DEFAULTS, **overrides}, source="audit options")


def run_audit(
    config: TrainConfig,
    canaries: int,
    *,
    confidence: float = 0.95,
    data: DataSplits | None = None,
    on_step: StepCallback | None = None,
) -> AuditResult:
    """Audit ``config``'s private training with ``canaries`` gradient canaries: one run as
    configured, and one control run with the noise off (everything else equal), which must
    certify more than the claimed epsilon for the audit to have shown it could see a leak.

    The runs take ``config.training.epochs`` passes with a constant learning rate (the guarantee, so
    the audit, does not depend on the schedule) and skip evaluation.
    """
    check_audit(config, canaries, confidence)
    started = time.perf_counter()
    data = data if data is not None else load_data(config)
    real, plan = scored_run(config, data, canaries, confidence, on_step=on_step)
    control, _ = scored_run(config, data, canaries, confidence, noise=False, on_step=on_step)
    return AuditResult(
        optimizer=config.optimizer.name,
        claimed_epsilon=plan.target_epsilon,
        delta=config.privacy.delta,
        canaries=canaries,
        confidence=confidence,
        sample_rate=plan.sample_rate,
        steps=real.steps,
        noise_multiplier=plan.noise_multiplier,
        claimed_mu=clt_mu(plan.sample_rate, plan.noise_multiplier, real.steps),
        real=real,
        control=control,
        epsilon_at_measured_noise=epsilon_spent(
            real.measured_noise_multiplier,
            plan.sample_rate,
            real.steps,
            plan.delta,
            plan.accountant,
        ),
        wall_time_s=time.perf_counter() - started,
    )


def scored_run(
    config: TrainConfig,
    data: DataSplits,
    canaries: int,
    confidence: float = 0.95,
    *,
    noise: bool = True,
    on_step: StepCallback | None = None,
) -> tuple[RunAudit, PrivacyPlan]:
    """Train ``config`` once, through the one training loop, with ``canaries`` canaries in
    (noise off for the control) and score them from the privatised gradients."""
    # a constant learning rate, as documented in run_audit
    config = config.replace(lr_schedule="constant")
    with global_generators_restored():
        task = f"{config.optimizer.name} {'audit' if noise else 'noise-off control'}"
        options = RunOptions(task=task, noise_off=not noise)
        run = TrainingRun.set_up(config, data, PhaseTimes(), on_step, options)
        private = run.setup.private
        plan = private.plan
        norm = CANARY_NORM_IN_CLIPS * plan.max_grad_norm
        drawn = Canaries.draw(last_linear(run.setup.model), canaries, norm, config.runtime.seed)
        examples = CanaryExamples(drawn, run.setup, config.runtime.seed)
        # the canaries go through the engine with the batch
        run.run_epochs(evaluate=False, batch_filter=examples.take)
        scores = examples.scores().numpy()
        if not np.isfinite(scores).all():
            raise DpivonError(
                f"training diverged during the audit of {config.optimizer.name}: lower the "
                f"learning rate (lr={config.optimizer.lr})"
            )
        included = drawn.included.numpy()
    best = audit_scores(scores, included, config.privacy.delta, confidence)
    gaussian = gaussian_mu(scores, included, confidence)
    n_included = int(included.sum())
    result = RunAudit(
        noise_multiplier=float(private.optimizer.noise_multiplier),
        epsilon_lower_bound=best.epsilon_lower_bound,
        mu=gaussian.mu,
        mu_lower_bound=gaussian.mu_lower_bound,
        epsilon_certified=gdp_epsilon(gaussian.mu_lower_bound, config.privacy.delta),
        guesses=best.guesses,
        correct_guesses=best.correct,
        k_plus=best.k_plus,
        k_minus=best.k_minus,
        steps=examples.steps,
        included=n_included,
        mean_times_sampled=float(examples.times_sampled.sum()) / max(n_included, 1),
        measured_noise_multiplier=examples.noise_estimate() * float(noise),
    )
    return result, plan
