"""The one training loop: `train` runs a config from its data to its result, as phases
(set up, restore, epochs, finish) that `TrainingRun` names. The CLI's `train`, sweep trials,
benchmark runs and the audit all run through it; tracking is not done here: callers pass
``on_epoch_end`` (MLflow logging, Ray reports, checkpoints) and receive a `TrainResult`.

config -> data -> model -> privacy plan -> optimizer (+ Opacus) -> epochs -> metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dpivon.config import TrainConfig
from dpivon.data import DataSplits
from dpivon.evaluation import Evaluation, Posterior, evaluate_as_configured
from dpivon.evaluation.metrics import ReliabilityDiagram, reliability_diagram
from dpivon.optim.dp_ivon import DPIVON
from dpivon.privacy.validation import private_validation_scores
from dpivon.runs.checkpoint import restore_training_state, training_state
from dpivon.runs.phases import PhaseTimes, timed_batches
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
    global_generators_restored,
    load_data,
    lr_scheduler,
    parameters_finite,
    resolve_device,
    seed_everything,
    train_step,
)

# Steps between two measurements of DP-IVON's curvature_update_share (and the first step of
# each epoch): it costs a second mean update per tensor, a tenth of DP-IVON's step.
UPDATE_SHARE_EVERY = 10
# More validation scores of an epoch's model and posterior (`dpivon.evaluation.shift`'s under shift)
ValidationScores = Callable[[nn.Module, Posterior | None], dict[str, float]]
# A change to each batch before its step (the audit's canaries)
BatchFilter = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class RunOptions:
    """How a driver adapts one run, given when the run is made (never set on it after)."""

    task: str | None = None  # the run's name in progress reports; None: its optimizer's
    extra_validation: ValidationScores | None = None  # more scores each epoch (val_<key>)
    noise_off: bool = False  # the audit's control: clipping and sampling, no noise


def _posterior(setup: TrainingSetup) -> Posterior | None:
    return Posterior.from_ivon(setup.model, setup.ivon) if setup.ivon else None


def _validation_scores(config: TrainConfig, setup: TrainingSetup, val: Evaluation) -> dict:
    """The validation scores a run releases: exact, or with ``val_noise_multiplier`` only
    the Gaussian-noised accuracy and ECE (the exact ones, NLL and Brier are not released)."""
    if config.evaluation.val_noise_multiplier == 0:
        return val.metrics
    diagram = reliability_diagram(val.probs, val.labels, config.evaluation.ece_bins)
    return private_validation_scores(
        diagram.bin_sums(), config.evaluation.val_noise_multiplier, setup.randomness
    )


def _diverged(config: TrainConfig, setup: TrainingSetup, epoch: int) -> TrainingDiverged:
    """The error of a run whose parameters are no longer finite, with the planned mechanism
    of a private run (the tuning cost counts a diverged trial too)."""
    plan = setup.private.plan if setup.private is not None else None
    return TrainingDiverged(
        f"training diverged at epoch {epoch}: the parameters are no longer "
        f"finite; lower the learning rate (lr={config.optimizer.lr:g})",
        privacy={
            "noise_multiplier": plan.noise_multiplier,
            "sample_rate": plan.sample_rate,
            "steps": plan.steps,
        }
        if plan is not None
        else None,
    )


class TrainingRun:
    """One training run, as the phases it runs: set up, restore (a resumed run), the epochs
    (`run_epochs`: each one's steps, then its evaluation and report), finish (the test and
    the result). Each is timed under `PHASES` in ``phases``; ``options`` adapt it to its
    driver."""

    def __init__(
        self,
        config: TrainConfig,
        data: DataSplits,
        device: torch.device,
        setup: TrainingSetup,
        phases: PhaseTimes,
        on_step: StepCallback | None,
        options: RunOptions = RunOptions(),
    ) -> None:
        self.config, self.data, self.device, self.setup = config, data, device, setup
        self.phases, self.on_step = phases, on_step
        if options.noise_off:
            setup.private.optimizer.noise_multiplier = 0.0
        self.scheduler = lr_scheduler(config, setup)
        self.dp_ivon = setup.ivon if isinstance(setup.ivon, DPIVON) else None
        self.first_epoch = 0
        self.history: list[dict[str, float]] = []
        self.total_steps = config.training.epochs * len(setup.loader)
        self.steps_done = 0
        self.posterior: Posterior | None = None
        self.val: dict[str, float] | None = None  # the last epoch's released scores
        self.extra_validation = options.extra_validation
        self.task = options.task or config.optimizer.name

    @classmethod
    def set_up(
        cls,
        config: TrainConfig,
        data: DataSplits | None,
        phases: PhaseTimes,
        on_step: StepCallback | None,
        options: RunOptions = RunOptions(),
    ) -> TrainingRun:
        """Seeds, device, data (phase "data"), model, optimizer and privacy ("setup"). The
        seeds are the global generators': its callers run it inside
        :func:`global_generators_restored`."""
        seed_everything(config.runtime.seed)
        device = resolve_device(config.runtime.device)
        phases.device = device
        with phases.phase("data"):
            data = data if data is not None else load_data(config)
        with phases.phase("setup"):
            setup = build_training(config, data, device)
            return cls(config, data, device, setup, phases, on_step, options)

    def restore(self, state: dict) -> None:
        """Continue a checkpointed run after its last epoch (phase "setup")."""
        with self.phases.phase("setup"):
            restored = restore_training_state(state, self.setup, self.scheduler)
        self.first_epoch, self.history = restored
        self.steps_done = self.first_epoch * len(self.setup.loader)

    def report_step(self, status: str) -> None:
        if self.on_step is not None:
            self.on_step(StepReport(self.task, self.steps_done, self.total_steps, status))

    def train_epoch(
        self, epoch: int, batch_filter: BatchFilter | None = None
    ) -> tuple[list[float], list[dict[str, float]]]:
        """The epoch's optimizer steps: their losses and DPIVON's per-step diagnostics;
        ``batch_filter`` changes each batch before its step (the audit puts its canaries
        in there, so that they go through the engine like any example)."""
        setup, phases = self.setup, self.phases
        setup.trained_module.train()
        losses, step_diagnostics = [], []
        for step, (x, y) in enumerate(timed_batches(setup.loader, self.device, phases)):
            if batch_filter is not None:
                x, y = batch_filter(x, y)
            if self.dp_ivon is not None:
                self.dp_ivon.track_update_share = step % UPDATE_SHARE_EVERY == 0
            with phases.phase("train"):
                loss = train_step(setup, x, y, self.config.optimizer.samples_per_step)
            if not parameters_finite(setup.model):
                raise _diverged(self.config, setup, epoch)
            losses.append(loss)
            step_diagnostics.append(self.dp_ivon.step_diagnostics if self.dp_ivon else {})
            self.scheduler.step()
            self.steps_done += 1
            self.report_step(f"epoch {epoch}")
        return losses, step_diagnostics

    def evaluate_epoch(
        self, epoch: int, losses: list[float], step_diagnostics: list[dict[str, float]]
    ) -> dict[str, float]:
        """What the epoch releases: training loss, validation scores (phase "validation"),
        the privacy spent so far and, for IVON, the curvature ("diagnostics")."""
        config, setup, phases = self.config, self.setup, self.phases
        self.posterior = _posterior(setup)
        with phases.phase("validation"):
            val_samples = config.evaluation.val_bma_samples
            val = evaluate_as_configured(
                config, setup.model, self.data.val, self.posterior, bma_samples=val_samples
            )
            self.val = _validation_scores(config, setup, val)
            if self.extra_validation is not None:  # e.g. a sweep's objective under shift
                self.val = {**self.val, **self.extra_validation(setup.model, self.posterior)}
        metrics = {"epoch": epoch, "train_loss": float(np.nanmean(losses)) if losses else 0.0}
        metrics.update({f"val_{k}": v for k, v in self.val.items()})
        if config.evaluation.test_every_epoch:
            with phases.phase("test"):
                test = evaluate_as_configured(
                    config, setup.model, self.data.test, self.posterior, bma_samples=val_samples
                )
            metrics["epoch_test_accuracy"] = test.metrics["accuracy"]
        if setup.private is not None:
            plan = setup.private.plan
            metrics.update(
                epsilon_spent=setup.private.epsilon_spent(),
                noise_multiplier=plan.noise_multiplier,
                sample_rate=plan.sample_rate,
                steps=setup.private.steps_taken,
            )
        if setup.ivon is not None:
            with phases.phase("diagnostics"):
                metrics.update(setup.ivon.curvature_diagnostics())
                # per-step diagnostics (projected_fraction, curvature_update_share) as
                # means over the epoch's steps that computed them, not the last step's
                keys = dict.fromkeys(k for d in step_diagnostics for k in d)
                metrics.update(
                    {k: float(np.mean([d[k] for d in step_diagnostics if k in d])) for k in keys}
                )
        return metrics

    def run_epochs(
        self,
        on_epoch_end: Callable[[EpochReport], None] | None = None,
        *,
        evaluate: bool = True,
        batch_filter: BatchFilter | None = None,
    ) -> None:
        """Every epoch after the restored one; without ``evaluate`` only their steps (the
        audit scores its canaries, not the model)."""
        for epoch in range(self.first_epoch + 1, self.config.training.epochs + 1):
            losses, step_diagnostics = self.train_epoch(epoch, batch_filter)
            if evaluate:
                metrics = self.evaluate_epoch(epoch, losses, step_diagnostics)
                self.end_epoch(epoch, metrics, on_epoch_end)

    def checkpoint(self, epoch: int) -> dict:
        """The resumable state after ``epoch`` (phase "checkpoint")."""
        with self.phases.phase("checkpoint"):
            return training_state(epoch, self.setup, self.scheduler, self.history)

    def end_epoch(
        self,
        epoch: int,
        metrics: dict[str, float],
        on_epoch_end: Callable[[EpochReport], None] | None,
    ) -> None:
        """Record the epoch and hand it to ``on_epoch_end`` (phase "logging")."""
        self.history.append(metrics)
        self.report_step(f"epoch {epoch} val acc {self.val['accuracy']:.3f}")
        if on_epoch_end is None:
            return
        phases = self.phases
        checkpoint_s = phases.seconds["checkpoint"]
        with phases.phase("logging"):
            on_epoch_end(EpochReport(epoch, metrics, lambda: self.checkpoint(epoch)))
        # a checkpoint the callback built is a phase of its own
        phases.seconds["logging"] -= phases.seconds["checkpoint"] - checkpoint_s

    def test(self) -> tuple[dict[str, float], ReliabilityDiagram]:
        """The final test's metrics and reliability diagram (phase "test")."""
        config, model = self.config, self.setup.model
        with self.phases.phase("test"):
            result = evaluate_as_configured(config, model, self.data.test, self.posterior)
            diagram = reliability_diagram(result.probs, result.labels, config.evaluation.ece_bins)
        return result.metrics, diagram

    def finish(self, *, evaluate_test: bool, started: float) -> TrainResult:
        """The test (if asked) and the run's result; the model moves to the CPU."""
        if self.val is None:  # resumed after the last epoch: the scores that epoch released
            self.posterior = _posterior(self.setup)
            last = self.history[-1]
            self.val = {k.removeprefix("val_"): v for k, v in last.items() if k.startswith("val_")}
        test, diagram = self.test() if evaluate_test else (None, None)
        private = self.setup.private
        return TrainResult(
            config=self.config,
            privacy=private.plan if private else None,
            epsilon_spent=private.epsilon_spent() if private else None,
            steps=private.steps_taken if private else self.total_steps,
            train_images=len(self.data.train),
            history=self.history,
            val=self.val,
            test=test,
            test_reliability=diagram,
            model=self.setup.model.cpu(),
            posterior=self.posterior,
            wall_time_s=time.perf_counter() - started,
            engine=private.engine if private else None,
            phases=self.phases,
        )


def train(
    config: TrainConfig,
    *,
    data: DataSplits | None = None,
    on_epoch_end: Callable[[EpochReport], None] | None = None,
    resume_state: dict | None = None,
    evaluate_test: bool = True,
    on_step: StepCallback | None = None,
    phases: PhaseTimes | None = None,
    extra_validation: ValidationScores | None = None,
) -> TrainResult:
    """Train ``config`` and evaluate it; see the module docstring for the pipeline.
    ``phases`` (a fresh one if None) accumulates the seconds of each phase;
    ``extra_validation`` adds its scores of the model and posterior to each epoch's
    validation scores (``val_<key>``)."""
    started = time.perf_counter()
    with global_generators_restored():
        phases = phases if phases is not None else PhaseTimes()
        options = RunOptions(extra_validation=extra_validation)
        run = TrainingRun.set_up(config, data, phases, on_step, options)
        if resume_state is not None:
            run.restore(resume_state)
        run.run_epochs(on_epoch_end)
        return run.finish(evaluate_test=evaluate_test, started=started)
