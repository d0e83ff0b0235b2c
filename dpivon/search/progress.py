"""A sweep's progress on the console: one line per finished trial with its group's and the
sweep's tally (`SweepProgress`, in place of Tune's wide tables), and a failed trial's error
in one line."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ray import tune
from ray.tune.experiment import Trial
from rich.console import Console

from dpivon.search.trial import COMPLETE, DIVERGED, DIVERGED_ERROR, GROUP_KEY

console = Console(stderr=True)


def trial_error(trial: Trial) -> str:
    """The last line of the trial's error file: the exception, without Ray's traceback."""
    error_file = getattr(trial, "error_file", None)
    try:
        lines = [line for line in Path(error_file).read_text().splitlines() if line.strip()]
        return lines[-1][:2000] if lines else str(error_file)
    except (OSError, TypeError):
        return "failed (see the Ray trial logs)"


# What became of a trial, as the progress line counts it.
COMPLETED, STOPPED, FAILED, RUNNING, WAITING = (
    "completed", "stopped early", "failed", "running", "waiting"
)  # fmt: skip


def trial_outcome(trial: Trial) -> str:
    """A trial's state for the tally, from Tune's status and its last report."""
    if trial.status == "ERROR":
        return FAILED
    if trial.status == "RUNNING":
        return RUNNING
    if trial.status != "TERMINATED":
        return WAITING  # pending, paused
    result = trial.last_result or {}
    if result.get(DIVERGED):
        return FAILED
    return COMPLETED if result.get(COMPLETE) else STOPPED


def tally(
    trials: Iterable[Trial],
    total: int | None,
    group: str | None = None,
    now: Mapping[str, str] | None = None,
) -> dict[str, int | None]:
    """How many of ``total`` trials (of the sweep, or of ``group``) are completed, stopped
    early, failed, running and waiting (not started, or not yet created by the searcher):
    the counts always add up to ``total``. ``now`` holds the outcome of a trial whose event
    is being handled (Tune updates its status only after the callbacks). With ``total``
    None (a trial count kept private for the random-trials bound) nothing is waiting."""
    counts = dict.fromkeys((COMPLETED, STOPPED, FAILED, RUNNING), 0)
    for trial in trials:
        if group is not None and trial.config.get(GROUP_KEY) != group:
            continue
        outcome = (now or {}).get(trial.trial_id) or trial_outcome(trial)
        if outcome in counts:
            counts[outcome] += 1
    counts[WAITING] = None if total is None else total - sum(counts.values())
    return counts


def tally_line(counts: dict[str, int]) -> str:
    """``7/12 finished (5 completed, 1 stopped early, 1 failed), 2 running, 3 waiting``;
    without the total and the waiting count where the trial count is private."""
    finished = counts[COMPLETED] + counts[STOPPED] + counts[FAILED]
    outcomes = (
        f"({counts[COMPLETED]} completed, {counts[STOPPED]} stopped early, "
        f"{counts[FAILED]} failed), {counts[RUNNING]} running"
    )
    if counts[WAITING] is None:
        return f"{finished} finished {outcomes}"
    total = finished + counts[RUNNING] + counts[WAITING]
    return f"{finished}/{total} finished {outcomes}, {counts[WAITING]} waiting"


class SweepProgress(tune.Callback):
    """One line per finished trial, instead of Tune's wide tables: its group's tally and
    the whole sweep's, both counted from Tune's trials (exact after a resume too)."""

    def __init__(
        self, group: str, total: int | None, sweep_total: int | None, objective: str, mode: str
    ):
        # totals None: the trial counts are private (the random-trials bound)
        self.group, self.total, self.sweep_total = group, total, sweep_total
        self.objective, self.mode = objective, mode
        self.best = -math.inf if mode == "max" else math.inf

    def _line(self, trial, what: str, trials, outcome: str | None = None) -> None:
        now = {trial.trial_id: outcome} if outcome else {}
        value = (trial.last_result or {}).get(self.objective)
        finite = isinstance(value, float) and math.isfinite(value)  # NaN after a divergence
        shown = f" {self.objective}={value:.4f}" if finite else ""
        best = f" | best {self.objective}={self.best:.4f}" if math.isfinite(self.best) else ""
        group = tally(trials, self.total, self.group, now)
        sweep = tally(trials, self.sweep_total, now=now)
        console.print(
            f"[bold]{self.group}[/] trial {trial.trial_id} {what}{shown} | {self.group} "
            f"{tally_line(group)} | sweep {tally_line(sweep)}{best}",
            highlight=False,
        )

    def on_trial_complete(
        self, iteration: int, trials: list[Trial], trial: Trial, **info: Any
    ) -> None:
        result = trial.last_result or {}
        if result.get(DIVERGED):
            what, outcome = f"[red]diverged[/] ({result.get(DIVERGED_ERROR)})", FAILED
        elif result.get(COMPLETE):
            what, outcome = "completed", COMPLETED
            value = result.get(self.objective)
            if isinstance(value, float) and math.isfinite(value):
                self.best = max(self.best, value) if self.mode == "max" else min(self.best, value)
        else:
            what, outcome = "stopped early (ASHA)", STOPPED
        self._line(trial, what, trials, outcome)

    def on_trial_recover(
        self, iteration: int, trials: list[Trial], trial: Trial, **info: Any
    ) -> None:
        # a failed attempt (a lost node, a crash) that Tune retries (FailureConfig)
        self._line(
            trial, f"[yellow]retried[/] from its last checkpoint ({trial_error(trial)})", trials
        )

    def on_trial_error(
        self, iteration: int, trials: list[Trial], trial: Trial, **info: Any
    ) -> None:
        self._line(trial, f"[red]failed[/] ({trial_error(trial)})", trials, FAILED)
