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


def parent_description(
    front: pd.DataFrame,
    objectives: list[tuple[str, str]],
    privacy: dict[str, dict[str, Any]],
    research_mode: bool = False,
) -> str:
    """The parent run's Markdown description: the released front rows and the epsilons to
    quote, within MLflow's tag length (rows that do not fit are left to the front's CSV).
    A group whose trial count is private shows its distribution, not the count. In research
    mode it opens by saying that no DP guarantee holds."""
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
    ]

    def text(shown: int) -> str:
        more = [] if shown == len(rows) else ["", f"_{len(rows) - shown} more in {FRONT_FILE}_"]
        return "\n".join([*header, *rows[:shown], *more, *quoted])

    shown = len(rows)
    while shown > 0 and len(text(shown)) > NOTE_LIMIT:
        shown -= 1
    return text(shown)[:NOTE_LIMIT]
