"""What a pipeline implies for its trials: its (optimizer, budget) groups, each group's trial
count and base config, the noise-faithful trial's settings, the mechanisms the tuning's
privacy bounds range over, and the notes said before a sweep starts. `TrialPlan` is mixed
into `dpivon.search.pipeline.Pipeline` and reads its validated fields."""

from __future__ import annotations

import math
from typing import Any

from dpivon.config import TrainConfig, parse_config
from dpivon.errors import DpivonError
from dpivon.orchestration.run_file import group_budget
from dpivon.privacy.accounting import noise_faithful_plan, sampling_schedule
from dpivon.privacy.tuning import (
    SweepConditions,
    TrialMechanism,
    candidate_mechanisms,
    draw_trial_count,
)
from dpivon.runs import frozen_curvature_warning

# NSGA-II's first generation is drawn at random (Optuna's default population)
NSGA2_POPULATION = 50


class TrialPlan:
    """The trial-side reading of a validated pipeline (a mixin of `Pipeline`)."""

    @property
    def conditions(self) -> SweepConditions:
        """How its trials are chosen and what is released: what the tuning bounds assume."""
        return SweepConditions(
            trial_count=self.trial_count,
            mean_trials=float(self.trials),
            adaptive_sampler=self.sampler != "random",
            adaptive_scheduler=self.scheduler.type != "none",
            release=self.release,
            start_points=any(space.start_points for space in self._spaces.values()),
        )

    @property
    def startup_trials(self) -> int:
        """Trials a group's sampler draws at random before it models the results: for TPE
        at most a third of the group's (mean) trials, at least one (Optuna's default of 10
        would leave a small budget to random search); NSGA-II's first generation; all of
        them for the random sampler."""
        if self.sampler == "tpe":
            return max(1, self.trials // 3)
        return NSGA2_POPULATION if self.sampler == "nsga2" else self.trials

    def random_phase_note(self) -> str | None:
        """One line when some group's budget leaves an adaptive sampler in its random phase
        (every trial a random draw or a start point), said before the sweep starts."""
        if self.sampler == "random":
            return None
        for name, space in self.spaces.items():
            modelled = self.trials - max(self.startup_trials, len(space.start_points))
            if modelled <= 0:
                return (
                    f"note: sampler {self.sampler} draws its first {self.startup_trials} "
                    f"trials at random and {name} has {len(space.start_points)} start "
                    f"point(s): with trials {self.trials} no trial of {name} is chosen by the "
                    f"sampler's model (random search); raise trials above "
                    f"{max(self.startup_trials, len(space.start_points))}"
                )
        return None

    def frozen_curvature_warnings(self) -> list[str]:
        """`dpivon.runs.frozen_curvature_warning` of each distinct start config whose
        curvature cannot learn: said before the sweep starts, which it does not stop."""
        lines = (frozen_curvature_warning(config) for config in self.start_configs())
        return list(dict.fromkeys(line for line in lines if line))

    def start_configs(self) -> list[TrainConfig]:
        """Every group's start points as configs (its fixed keys alone where it has none
        and samples no ``beta2``): the runs a sweep is warned of before it starts."""
        configs = []
        for optimizer, budget in self.groups:
            space = self.spaces[optimizer]
            base = self.base_train_config(optimizer, budget)
            if space.start_points:
                points = [space.trial_config(point) for point in space.start_points]
            else:
                points = [] if "beta2" in space.distributions else [space.fixed]
            configs += [parse_config({**base, **point}) for point in points]
        return configs

    @property
    def hides_trial_count(self) -> bool:
        """Whether the random-trials bound is quoted: it holds only while K and the random
        sampler's draws stay unknown, so both come from the OS entropy source and K is
        neither logged nor reported."""
        return not self.conditions.random_trials_obstacles()

    @property
    def groups(self) -> list[tuple[str, float]]:
        """Every (optimizer, budget) group, epsilon by epsilon in the listed orders; a
        non-private optimizer has one group, at budget inf (see :func:`group_budget`)."""
        keys = [
            (name, group_budget(name, eps))
            for eps in self.epsilon_list
            for name in self.optimizer_names
        ]
        return list(dict.fromkeys(keys))

    @property
    def owned_keys(self) -> frozenset[str]:
        return frozenset(self.owned_settings(self.optimizers[0].name, math.inf))

    def train_blocks(self) -> dict[str, dict[str, Any]]:
        entries = {f"optimizers.{i}.train": e.train for i, e in enumerate(self.optimizers)}
        return {"train": self.train, **entries}

    @property
    def validation_shift_severity(self) -> int | None:
        """The severity each trial scores its validation images at, every epoch, when an
        objective is a ``val_shift_*`` metric; else None (no trial pays for it)."""
        shifted = any(o.metric.startswith("val_shift_") for o in self.objectives)
        return self.shift_severity if shifted else None

    @property
    def objective_pairs(self) -> list[tuple[str, str]]:
        """The two objectives as (metric, mode) pairs; the first one drives ASHA."""
        return [(o.metric, o.mode) for o in self.objectives]

    @property
    def epsilon_list(self) -> list[float]:
        """The groups' budgets, in the listed order (``inf`` = non-private): each trial's,
        or with ``total_epsilon`` the one budget of each group's release."""
        if self.epsilons is None:
            return [float(self.total_epsilon)]
        return [float(e) for e in self.epsilons]

    def trial_counts(self) -> dict[tuple[str, float], int]:
        """The number of trials of each (optimizer, budget) group, in listed order.

        ``fixed``: ``trials``. Otherwise drawn once per group by :func:`draw_trial_count`
        from the OS entropy source: a sweep calls this once when it starts and keeps the
        counts in its state file (private, like the checkpoints), so a resume keeps them.
        """
        return {group: draw_trial_count(self.trial_count, self.trials) for group in self.groups}

    def candidate_mechanisms(self, optimizer: str, trial_epsilon: float) -> list[TrialMechanism]:
        """Mechanisms covering every trial ``optimizer``'s space can produce when each
        targets ``trial_epsilon`` (what the tuning bounds are over before trials run)."""
        if self.noise_faithful is not None:  # one plan, exact: no calibration to cover
            plans = [self.noise_faithful_settings(b) for b in self.epsilon_list]
            keys = next((p for p in plans if p["epsilon"] == trial_epsilon), None)
            if keys is None:
                raise DpivonError(
                    f"pipeline {self.path}: no noise-faithful group's trials spend epsilon "
                    f"{trial_epsilon:g}"
                )
            return [
                TrialMechanism(
                    keys["fixed_noise_multiplier"],
                    keys["batch_size"] / self.data.train_size,
                    keys["epochs"] * keys["steps_per_epoch"],
                    self.validation_noise,
                    keys["epochs"] if self.validation_noise > 0 else 0,
                )
            ]
        batch_sizes = self.spaces[optimizer].all_values("batch_size")
        if batch_sizes is None:
            base = self.base_train_config(optimizer, self.epsilon_list[0])
            batch_sizes = [parse_config(base).training.batch_size]
        return candidate_mechanisms(
            batch_sizes,
            dataset_size=self.data.train_size,
            epochs=self.epochs,
            target_epsilon=trial_epsilon,
            delta=self.delta,
            accountant=self.accountant,
            validation_noise_multiplier=self.validation_noise,
        )

    def owned_settings(self, optimizer: str, epsilon: float) -> dict[str, Any]:
        """The TrainConfig keys the pipeline's own keys set for every trial of a group that
        spends ``epsilon``: :attr:`owned_keys`, which no search space or ``train:`` may
        set, are this mapping's keys."""
        return {
            **self.shared_train_config(self.seed),
            "optimizer": optimizer,
            "epsilon": float(epsilon),
            "val_noise_multiplier": self.validation_noise,
            # Each trial's training seed (and in research mode its noise) is derived from
            # the pipeline seed and the trial id: see dpivon.search.trial.
            "seed": self.seed,
        }

    def base_train_config(
        self, optimizer: str, epsilon: float, trial_epsilon: float | None = None
    ) -> dict[str, Any]:
        """The TrainConfig keys every trial of (optimizer, epsilon) starts from.

        The pipeline's :meth:`owned_settings` and the ``train`` extras; a trial's config is
        this updated with ``spaces[optimizer].trial_config(...)``. With ``total_epsilon``,
        ``epsilon`` names the group and ``trial_epsilon`` is what its trials spend. A
        non-private optimizer's group is at inf, whatever ``epsilon`` is given.
        """
        if optimizer not in self._spaces:
            raise DpivonError(
                f"pipeline {self.path}: no optimizer {optimizer!r}; it has "
                f"{', '.join(self.optimizer_names)}"
            )
        budget = group_budget(optimizer, epsilon)
        if (optimizer, budget) not in self.groups:
            raise DpivonError(
                f"pipeline {self.path}: no epsilon {epsilon}; it has "
                f"{', '.join(map(str, self.epsilon_list))}"
            )
        spent = budget if trial_epsilon is None or math.isinf(budget) else trial_epsilon
        config = self.owned_settings(optimizer, spent)
        config.update(self.train)
        config.update(next(e.train for e in self.optimizers if e.name == optimizer))
        if self.noise_faithful is not None and math.isfinite(budget):
            config.update(self.noise_faithful_settings(budget))
        return config

    def noise_faithful_settings(self, budget: float) -> dict[str, Any]:
        """A private noise-faithful trial's keys at a group's ``budget``: batch B / k, the
        target's steps per epoch, the target's sigma over k and the epsilon that spends
        (the trial's own; the target run spends ``budget``)."""
        divisor, batch = self.noise_faithful.batch_divisor, self.train["batch_size"]
        sigma, epsilon = noise_faithful_plan(
            float(budget),
            self.delta,
            self.data.train_size,
            batch,
            divisor,
            self.epochs,
            self.accountant,
        )
        target_epochs_per_epoch = self.epochs // self.trial_epochs
        return {
            "batch_size": batch // divisor,
            "epochs": self.trial_epochs,
            "steps_per_epoch": target_epochs_per_epoch
            * sampling_schedule(self.data.train_size, batch)[1],
            "fixed_noise_multiplier": sigma,
            "epsilon": epsilon,
        }
