"""The sweep parent run's Markdown description (``mlflow.note.content``): the released
front rows and the epsilons to quote, within MLflow's tag length."""

from __future__ import annotations

from typing import Any

import pandas as pd

from dpivon.privacy.noise import RESEARCH_MODE_WARNING
from dpivon.search.sweep_files import FRONT_FILE

TEST_COLUMNS = ("test_accuracy", "test_ece", "test_nll")
NOTE_LIMIT = 8000  # the longest tag value MLflow stores (the description is a tag)


def _trials_cell(report: dict[str, Any]) -> str:
    if "num_trials" in report:
        return str(report["num_trials"])
    return f"{report['trial_count']}, mean {report['mean_trials']:g} (count private)"


def _shared_store(group: str, facts: dict[str, Any]) -> str:
    return (
        f"- **{group}**, if this store is shared: the quote above assumes K hidden, which "
        f"this store does not keep; against its readers the composition over the "
        f"{facts['num_trials']} trials that ran holds, epsilon "
        f"{facts['composition_epsilon']:.3g}"
    )


def parent_description(
    front: pd.DataFrame,
    objectives: list[tuple[str, str]],
    privacy: dict[str, dict[str, Any]],
    research_mode: bool = False,
    hidden_counts: dict[str, dict[str, Any]] | None = None,
) -> str:
    """The parent run's Markdown description: the released front rows and the epsilons to
    quote, within MLflow's tag length (rows that do not fit are left to the front's CSV).
    A group whose trial count is private shows its distribution, not the count, and the
    condition its quote rests on; ``hidden_counts`` (its :func:`composition_facts`) gives,
    beside it, what holds against readers of this store, which counts the trials anyway.
    In research mode it opens by saying that no DP guarantee holds."""
    hidden_counts = hidden_counts or {}
    columns = [
        "optimizer",
        "epsilon",
        "trial_id",
        *(metric for metric, _ in objectives),
        *(c for c in TEST_COLUMNS if c in front),
    ]
    warning = [f"**No DP guarantee**: {RESEARCH_MODE_WARNING}.", ""] if research_mode else []
    header = [
        *warning,
        "### Pareto fronts (validation; test scores of the members)",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    rows = [
        "| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |"
        for row in front[columns].itertuples(index=False)
    ]
    quoted = [
        "",
        "### Privacy of the tuning",
        "",
        "| group | trials | per-trial eps | composition eps | quoted eps | covers |",
        "|---|---|---|---|---|---|",
        *(
            f"| {group} | {_trials_cell(r)} | {r['trial_epsilon']:.3g} | "
            f"{format(r['composition_epsilon'], '.3g') if 'composition_epsilon' in r else '-'} "
            f"| {r['quoted_epsilon']:.3g} | {r['release']} release; {r['records_covered']} |"
            for group, r in privacy.items()
        ),
        "",
        *(f"- **{group}**: {r['quote']}" for group, r in privacy.items()),
        *(f"- **{group}**: {r['tuned_as']}" for group, r in privacy.items() if "tuned_as" in r),
        *(
            f"- **{group}**: {r['holds_while']}"
            for group, r in privacy.items()
            if "holds_while" in r
        ),
        *(
            _shared_store(group, hidden_counts[group])
            for group, r in privacy.items()
            if "holds_while" in r and group in hidden_counts
        ),
    ]

    def text(shown: int) -> str:
        more = [] if shown == len(rows) else ["", f"_{len(rows) - shown} more in {FRONT_FILE}_"]
        return "\n".join([*header, *rows[:shown], *more, *quoted])

    shown = len(rows)
    while shown > 0 and len(text(shown)) > NOTE_LIMIT:
        shown -= 1
    return text(shown)[:NOTE_LIMIT]
