"""The benchmark report: one Markdown file and one self-contained HTML page.

Both render the same blocks (headings, paragraphs, tables, figures), so they never
disagree; the HTML embeds every figure as a base64 PNG and needs no other file, the
Markdown links the PNGs written beside it. The results table and the verdict are
also what the parent MLflow run's description (``mlflow.note.content``) shows.

Its figures (`dpivon.study.figures`): metrics versus epsilon, reliability diagrams at the
smallest and largest finite epsilon, the curvature-collapse diagnostics over training per
epsilon (whatever the runs logged; methods without them are left out of those panels, and
the last epoch's values are tabled), and the Pareto fronts of the sweeps the tuned methods
came from.
"""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dpivon.evaluation.calibration import MIN_FIT_IMAGES
from dpivon.orchestration.storage import ResultsStorage
from dpivon.study.aggregate import (
    SUMMARISED,
    Comparison,
    RunRecord,
    aggregate,
    compare,
    records_frame,
    seed_values,
    verdict_epsilons,
)
from dpivon.study.figures import (
    pareto_png,
    plot_diagnostics,
    plot_metric_curves,
    plot_pooled_reliability,
    png_bytes,
)
from dpivon.study.significance import (
    Difference,
    Interval,
    RankAgreement,
    holm_adjusted,
    rank_agreement,
    seed_difference,
    verdict_word,
)
from dpivon.tracking.client import Tracker

REPORT_MD = "report.md"
REPORT_HTML = "report.html"
FIGURES = "figures"
RESULTS_CSV = "results.csv"
RUNS_CSV = "runs.csv"
STATISTICS_RULE = (
    "Intervals are 95 % t intervals over seeds (none where the seeds agree exactly: no "
    "spread measured). Two methods are compared by their per-seed "
    "differences (paired t-test over the seeds they share, else Welch's t-test): a method "
    '"leads" only where the 95 % interval of the difference excludes 0; otherwise the two '
    'are "indistinguishable" at that number of seeds (`dpivon.study.significance`). The '
    "pairs are replicate k of each method, fixed before the runs: they share the split and "
    "the test images, not their randomness, so the paired test is valid and, at a few "
    "seeds, conservative. The verdicts judge each comparison alone; p (Holm) adjusts each "
    "p-value for the other comparisons of its metric and epsilon (Holm's step-down): a "
    "verdict whose Holm p exceeds 0.05 may be one of the family's chance findings."
)
TEMPERATURE_NOTE = (
    "NLL (TS) and ECE (TS) are after post-hoc temperature scaling "
    "(`dpivon.evaluation.calibration`): "
    "one temperature T per run, fitted by NLL on the validation split's predictive and "
    "applied to the test predictive (accuracy is unchanged). It uses the validation records "
    "with exact scores, as the sweep does: they are held out from training, so the training "
    "epsilon does not cover them; a release would fit T on public data or privately. "
    "No T where the validation split does not determine one (fewer than "
    f"{MIN_FIT_IMAGES} images, or its NLL still falling at T = 0.01 or 100)."
)
COLUMN_NOTE = (
    "eps spent: the accountant's epsilon of the training (inf: no noise, clipping only); "
    "eps end to end: that training composed (RDP, `dpivon.privacy.tuning."
    "compose_with_tuning`) with the tuning that chose a tuned method's settings on the same "
    "images, what its released model costs (a method at fixed hyper-parameters: its "
    "training's, its settings not chosen on these images); "
    "wall s: the run's wall time over every attempt (training, per-epoch validation, the "
    "test, the temperature fit and, with `shift`, the scoring under shift; a run scored under "
    "shift later from its stored weights leaves that out), beside the other runs in flight; "
    "T: the fitted temperature (> 1 softens an over-confident predictive)."
)
# (column, header, scale, decimals) of the results table
_COLUMNS = (
    ("test_accuracy", "accuracy %", 100.0, 1),
    ("test_nll", "NLL", 1.0, 3),
    ("test_ece", "ECE", 1.0, 3),
    ("test_brier", "Brier", 1.0, 3),
    ("test_ts_nll", "NLL (TS)", 1.0, 3),
    ("test_ts_ece", "ECE (TS)", 1.0, 3),
    ("temperature", "T", 1.0, 2),
    ("epsilon_spent", "eps spent", 1.0, 2),
    ("epsilon_end_to_end", "eps end to end", 1.0, 2),
    ("wall_time_s", "wall s", 1.0, 0),
)
# (column, header, scale, decimals) of the last epoch's curvature diagnostics
_DIAGNOSTIC_COLUMNS = (
    ("last_projected_fraction", "projected fraction", 1.0, 3),
    ("last_clamped_noise_share_median", "clamped-noise share of h", 1.0, 3),
    ("last_hess_median", "median h", 1.0, 3),
    ("last_posterior_std_median", "median posterior std", 1.0, 4),
    ("last_curvature_horizon_share", "horizon share of h", 1.0, 3),
    ("last_curvature_learned_share_median", "learned share of h", 1.0, 3),
    ("last_curvature_update_share", "curvature's share of a step", 1.0, 3),
)
DIAGNOSTICS_NOTE = (
    "At the last epoch, mean [95 % interval] over seeds (`dpivon.optim.dp_ivon.DPIVON` documents "
    "them): "
    "projected fraction, the epoch's mean share of coordinates whose noise-corrected v_hat "
    "was negative and projected to zero (the curvature collapse); clamped-noise share of h, "
    "the median over coordinates of the share of h that the clamped noise alone would give "
    "(near 1: h is no larger than noise makes it); median h and median posterior std "
    "s = 1/sqrt(ess (h + delta)) over all coordinates. Whether h learned at all: horizon "
    "share of h, 1 - beta2^T after T steps, the most of h the estimates can have made (the "
    "rest is hess_init decayed); learned share of h, the median over coordinates of "
    "1 - hess_init beta2^T / h, what they made (0 for a frozen h, near 0 where the estimates "
    "collapse to 0); curvature's share of a step, ||step - step_0|| / ||step|| with step_0 "
    "the step at h = hess_init (the epoch's mean). A dash: a private-only diagnostic."
)
_HYPER_PARAMETERS = (
    "lr",
    "batch_size",
    "max_grad_norm",
    "momentum",
    "beta2",
    "hess_init",
    "weight_decay",
    "curvature_estimator",
    "curvature_ema",
    "curvature_pool",
    "hess_floor",
    "second_moment_floor",
    "lr_schedule",
    "bma_samples",
)


# --- blocks, rendered to Markdown and to HTML ----------------------------------------------


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Paragraph:
    text: str


@dataclass
class Bullets:
    items: list[str]


@dataclass
class TableBlock:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Images:
    """Figures side by side: file names (under figures/) with their PNG bytes."""

    names: list[str]
    caption: str = ""


Block = Heading | Paragraph | Bullets | TableBlock | Images


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _inline_html(text: str) -> str:
    """Escape, then the two inline marks the report uses: **bold** and `code`."""
    escaped = html.escape(text)
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", escaped)


_CSS = """
body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f2f2f2} td:first-child,th:first-child{text-align:left}
.images{display:flex;flex-wrap:wrap;gap:8px} .images img{max-width:100%}
figcaption{font-size:0.9em;color:#555}
code{background:#f4f4f4;padding:0 3px}
"""


@dataclass
class Report:
    """A built report: its blocks, figures (PNG bytes by file name) and numbers."""

    title: str
    blocks: list[Block]
    table: pd.DataFrame
    runs: pd.DataFrame
    verdict: list[str]
    figures: dict[str, bytes] = field(default_factory=dict)
    privacy: list[str] = field(default_factory=list)  # see privacy_lines

    def add_verdict(self, lines: Sequence[str]) -> None:
        """More verdict lines; the Verdict block lists ``verdict`` itself (the same list,
        see `_results_blocks`), so they show wherever the report is rendered."""
        self.verdict.extend(lines)

    def results_markdown(self) -> str:
        return markdown_table(*results_rows(self.table))

    def note(self) -> str:
        """The parent run's description: the two epsilons, verdict, rule and table, in
        Markdown."""
        privacy = "".join(f"- {line}\n" for line in self.privacy)
        verdict = "\n".join(f"- {line}" for line in self.verdict)
        return (
            f"**{self.title}**\n\n{privacy}\n{verdict}\n\n{STATISTICS_RULE}\n\n{self.results_markdown()}\n\n"
            f"Mean [95 % interval] over seeds. {TEMPERATURE_NOTE} Full report: artifact "
            f"`report/{REPORT_HTML}`."
        )

    def markdown(self) -> str:
        parts = [f"# {self.title}"]
        for block in self.blocks:
            if isinstance(block, Heading):
                parts.append("#" * block.level + " " + block.text)
            elif isinstance(block, Paragraph):
                parts.append(block.text)
            elif isinstance(block, Bullets):
                parts.append("\n".join(f"- {item}" for item in block.items))
            elif isinstance(block, TableBlock):
                parts.append(markdown_table(block.header, block.rows))
            else:
                images = " ".join(f"![{n}]({FIGURES}/{n})" for n in block.names)
                parts.append(images + (f"\n\n*{block.caption}*" if block.caption else ""))
        return "\n\n".join(parts) + "\n"

    def html(self) -> str:
        parts = [f"<h1>{html.escape(self.title)}</h1>"]
        for block in self.blocks:
            if isinstance(block, Heading):
                parts.append(f"<h{block.level}>{_inline_html(block.text)}</h{block.level}>")
            elif isinstance(block, Paragraph):
                parts.append(f"<p>{_inline_html(block.text)}</p>")
            elif isinstance(block, Bullets):
                items = "".join(f"<li>{_inline_html(item)}</li>" for item in block.items)
                parts.append(f"<ul>{items}</ul>")
            elif isinstance(block, TableBlock):
                head = "".join(f"<th>{_inline_html(h)}</th>" for h in block.header)
                body = "".join(
                    "<tr>" + "".join(f"<td>{_inline_html(c)}</td>" for c in row) + "</tr>"
                    for row in block.rows
                )
                parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
            else:
                images = "".join(
                    f'<img alt="{html.escape(n)}" src="data:image/png;base64,'
                    f'{base64.b64encode(self.figures[n]).decode()}">'
                    for n in block.names
                )
                caption = f"<figcaption>{_inline_html(block.caption)}</figcaption>"
                parts.append(f'<figure><div class="images">{images}</div>{caption}</figure>')
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(self.title)}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(parts)
            + "\n</body></html>\n"
        )


# --- numbers ---------------------------------------------------------------------------------


def mean_with_interval(
    mean: float, low: float, high: float, scale: float = 1.0, decimals: int = 3
) -> str:
    """``mean [low, high]`` (scaled); ``inf`` and missing values spelled out, the interval
    left out when it is unknown (one seed)."""
    if math.isnan(mean):
        return "-"
    if math.isinf(mean):
        return "inf"
    text = f"{mean * scale:.{decimals}f}"
    interval = Interval(low, high)
    return f"{text} {_interval_text(interval, scale, decimals)}" if interval.known else text


# columns that describe the runs rather than score them: their mean alone
_MEAN_ONLY = ("epsilon_spent", "epsilon_end_to_end", "wall_time_s")


def results_rows(
    table: pd.DataFrame, columns: Sequence[tuple[str, str, float, int]] = _COLUMNS
) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a table of ``columns`` (mean [95 % interval] over seeds; the
    mean alone for the epsilon spent and the wall time)."""
    header = ["method", "eps", "seeds", *(h for _, h, _, _ in columns)]
    rows = [
        [
            str(row["method"]),
            f"{row['epsilon']:g}",
            str(int(row["n"])),
            *(
                mean_with_interval(
                    row[f"{c}_mean"],
                    math.nan if c in _MEAN_ONLY else row[f"{c}_ci_low"],
                    math.nan if c in _MEAN_ONLY else row[f"{c}_ci_high"],
                    scale,
                    decimals,
                )
                for c, _, scale, decimals in columns
            ),
        ]
        for _, row in table.iterrows()
    ]
    return header, rows


def _interval_text(interval: Interval, scale: float, decimals: int) -> str:
    return f"[{interval.low * scale:.{decimals}f}, {interval.high * scale:.{decimals}f}]"


def difference_cells(
    d: Difference, scale: float, decimals: int, word: str, holm: float | None = None
) -> list[str]:
    """A difference's table cells: signed mean, 95 % interval, p-value, the Holm-adjusted
    p-value where the table has that column (``holm`` given), seeds, ``word``."""
    cells = [
        f"{d.mean * scale:+.{decimals}f}",
        _interval_text(d.interval, scale, decimals) if d.interval.known else "-",
        "-" if math.isnan(d.p_value) else f"{d.p_value:.2g}",
    ]
    if holm is not None:
        cells.append("-" if math.isnan(holm) else f"{holm:.2g}")
    return [*cells, str(d.seeds), word]


def _difference_text(d: Difference, scale: float, decimals: int, unit: str) -> str:
    if not d.interval.known:
        why = "the same difference on every seed" if d.seeds >= 2 else "one seed on a side"
        return f"{abs(d.mean) * scale:.{decimals}f}{unit} apart, {why}: no interval"
    return (
        f"difference {d.mean * scale:.{decimals}f}{unit}, 95 % CI "
        f"{_interval_text(d.interval, scale, decimals)}, {d.test_name} p = {d.p_value:.2g}, "
        f"{d.seeds} seeds"
    )


def comparison_text(c: Comparison | None, scale: float, decimals: int, unit: str) -> str | None:
    """The best method on one metric and how it stands against the runner-up, in the words
    the difference's interval allows (see STATISTICS_RULE)."""
    if c is None:
        return None
    best = f"**{c.best}** ({c.best_mean * scale:.{decimals}f}{unit})"
    if c.second is None:
        return f"{best}, the only method"
    second = f"{c.second} ({c.second_mean * scale:.{decimals}f}{unit})"
    detail = _difference_text(c.difference, scale, decimals, unit)
    if c.word == "leads":
        return f"{best} leads {second}: {detail}"
    if c.word == "unknown":
        return f"{best} ahead of {second} on the means, {detail}"
    if c.word == "trails":  # ranked over all seeds, tested on the shared ones: they disagree
        return (
            f"{best} ahead on the means over all seeds, but {c.second} leads on the "
            f"{c.difference.seeds} seeds both ran: {detail}"
        )
    n = c.difference.seeds
    return f"{best} and {second} are indistinguishable at {n} seeds: {detail}"


def verdict_lines(runs: pd.DataFrame) -> list[str]:
    """Per extreme epsilon: who has the best mean accuracy, NLL and ECE, and whether it
    leads the runner-up or is indistinguishable from it (see STATISTICS_RULE); then, where
    runs logged curvature diagnostics, which method collapses least at the last epoch.
    ``runs`` is one row per run (:func:`dpivon.study.aggregate.records_frame`)."""
    lines = []
    for eps in verdict_epsilons(runs):
        accuracy = comparison_text(compare(runs, "test_accuracy", eps), 100.0, 1, " points")
        nll = comparison_text(compare(runs, "test_nll", eps), 1.0, 3, "")
        ece = comparison_text(compare(runs, "test_ece", eps), 1.0, 3, "")
        lines.append(
            f"epsilon {eps:g}: best mean test accuracy {accuracy}; "
            f"lowest mean test NLL {nll}; lowest mean test ECE {ece}."
        )
        collapse = comparison_text(compare(runs, "last_projected_fraction", eps), 1.0, 3, "")
        if collapse is not None:
            lines.append(
                f"epsilon {eps:g}: lowest fraction of v_hat projected to zero at the last "
                f"epoch (one sign of curvature collapse; the diagnostics table has the "
                f"others) {collapse}."
            )
    return lines


# (column, header, scale, decimals) of the paired-differences table
_DIFFERENCE_METRICS = (
    ("test_accuracy", "accuracy (points)", 100.0, 1),
    ("test_nll", "NLL", 1.0, 3),
    ("test_ece", "ECE", 1.0, 3),
    ("test_ts_nll", "NLL (TS)", 1.0, 3),
    ("test_ts_ece", "ECE (TS)", 1.0, 3),
    ("test_shift_s3_accuracy", "accuracy at shift severity 3 (points)", 100.0, 1),
    ("test_shift_s3_ece", "ECE at shift severity 3", 1.0, 3),
    ("test_shift_s3_aurc_maxprob", "AURC (max-prob) at shift severity 3", 1.0, 3),
)


def difference_rows(
    runs: pd.DataFrame,
    methods: Sequence[str],
    metrics: Sequence[tuple[str, str, float, int]] = _DIFFERENCE_METRICS,
    directions: Mapping[str, str] = SUMMARISED,
) -> tuple[list[str], list[list[str]]]:
    """Every method against the best one, per epsilon and metric (column, label, scale,
    decimals; ``directions`` says which way each improves): the difference (method minus
    best), its 95 % interval, the test's p-value, that p-value adjusted by Holm's method over
    the comparisons of the same epsilon and metric, the seeds and the verdict word."""
    header = ["eps", "metric", "best", "method", "difference", "95 % CI", "p", "p (Holm)",
              "seeds", "verdict"]  # fmt: skip
    rows = []
    for eps in sorted(set(runs["epsilon"])):
        for metric, label, scale, decimals in metrics:
            comparison = compare(runs, metric, eps, directions[metric])
            if comparison is None or comparison.second is None:
                continue
            best = comparison.best
            reference = seed_values(runs, best, eps, metric)
            family = []  # (method, difference) of this epsilon and metric
            for method in methods:
                values = seed_values(runs, method, eps, metric)
                if method == best or not np.isfinite(list(values.values())).any():
                    continue
                family.append((method, seed_difference(values, reference)))
            adjusted = holm_adjusted([d.p_value for _, d in family])
            for (method, d), holm in zip(family, adjusted, strict=True):
                word = verdict_word(d, comparison.better)
                word = "trails the best" if word == "trails" else word
                cells = difference_cells(d, scale, decimals, word, holm)
                rows.append([f"{eps:g}", label, best, method, *cells])
    return header, rows


TRANSFER_NOTE = (
    "Each tuned method's pick has a score in its tuning sweep (the sweep's first objective, "
    "on the validation split, at the tuning protocol's length and data) and a final score "
    "(the same metric on the test set, mean over seeds, at the benchmark's). The tuning "
    '"predicted" the final runs where Kendall\'s tau is positive at p < 0.05; with few '
    "picks only a near-perfect agreement is significant."
)


KNOWN_SETTING_NOTE = (
    "Each tuned method beside every method of the same optimizer at fixed hyper-parameters "
    "(those the benchmark file gives, such as a published setting, over the registry's "
    "defaults): test accuracy of the pick minus the fixed setting's, over the seeds. "
    '"leads": the tuning found a better setting for the final runs; "trails": it '
    "picked a worse one than the fixed setting."
)


def final_metric(tuning_metric: str) -> str:
    """The test metric a validation objective stands for (val_accuracy -> test_accuracy)."""
    return "test_" + tuning_metric.removeprefix("val_")


@dataclass(frozen=True)
class TransferCheck:
    """One epsilon's transfer check: the tuning metric, each pick's (tuning score, final
    mean over ``seeds``, the replicates every pick finished) and their rank agreement."""

    epsilon: float
    metric: str
    pairs: dict[str, tuple[float, float]]
    seeds: int
    agreement: RankAgreement


def transfer_checks(
    runs: pd.DataFrame, tuning_scores: dict[tuple[str, float], tuple[str, float]]
) -> list[TransferCheck]:
    """Per epsilon with tuned methods: each pick's tuning score against its final mean and
    the rank agreement of the two (larger-is-better for both). The final means are over the
    seeds that every pick finished, so that a benchmark under way ranks like for like."""
    checks = []
    for eps in sorted({e for _, e in tuning_scores}):
        picks = {m: score for (m, e), score in tuning_scores.items() if e == eps}
        metric = next(iter(picks.values()))[0]
        final = final_metric(metric)
        if final not in runs:
            continue
        at = runs[(runs["epsilon"] == eps) & runs["method"].isin(list(picks))]
        # one column per pick that has a finite value, one row per seed all of them have
        by_seed = at.pivot(index="replicate", columns="method", values=final)
        by_seed = by_seed.dropna(axis="columns", how="all").dropna()
        pairs = {m: (picks[m][1], float(v)) for m, v in by_seed.mean().items()}
        shared = len(by_seed)
        sign = -1.0 if SUMMARISED.get(final) == "min" else 1.0
        agreement = rank_agreement(
            {m: sign * t for m, (t, _) in pairs.items()},
            {m: sign * f for m, (_, f) in pairs.items()},
        )
        checks.append(TransferCheck(eps, metric, pairs, shared, agreement))
    return checks


def known_setting_pairs(method_configs: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(tuned method, fixed method) of the same optimizer: a sweep's pick beside fixed
    hyper-parameters (a published setting), whose final runs say whether the tuning paid."""
    tuned = [m for m, c in method_configs.items() if c.get("tuned_by")]
    fixed = [m for m, c in method_configs.items() if not c.get("tuned_by")]
    return [
        (t, f)
        for t in tuned
        for f in fixed
        if method_configs[t]["optimizer"] == method_configs[f]["optimizer"]
    ]


def known_setting_checks(
    runs: pd.DataFrame, pairs: Sequence[tuple[str, str]]
) -> list[tuple[float, str, str, Difference]]:
    """Per epsilon both ran at: (epsilon, tuned, fixed, test accuracy of tuned minus fixed
    over the seeds, paired where they share two or more)."""
    checks = []
    for tuned, fixed in pairs:
        for eps in sorted(set(runs["epsilon"])):
            picked = seed_values(runs, tuned, eps, "test_accuracy")
            known = seed_values(runs, fixed, eps, "test_accuracy")
            if picked and known:
                checks.append((eps, tuned, fixed, seed_difference(picked, known)))
    return checks


def known_setting_line(eps: float, tuned: str, fixed: str, d: Difference) -> str:
    """The verdict's sentence on whether a tuned pick beat its optimizer's fixed setting."""
    detail = _difference_text(d, 100.0, 1, " points")
    said = {
        "leads": f"the tuned **{tuned}** leads {fixed}",
        "trails": f"the tuned {tuned} trails **{fixed}**",
        "indistinguishable": f"the tuned {tuned} and {fixed} are indistinguishable at "
        f"{d.seeds} seeds",
        "unknown": f"the tuned {tuned} against {fixed}",
    }[verdict_word(d, "max")]
    return (
        f"epsilon {eps:g}: {said} (the same optimizer at fixed hyper-parameters), test "
        f"accuracy {detail}."
    )


def transfer_line(eps: float, metric: str, agreement: RankAgreement) -> str:
    """The verdict's sentence on whether the tuning predicted the final ranking."""
    if agreement.word == "unknown":
        return (
            f"epsilon {eps:g}: {agreement.items} tuned pick(s): too few to say whether the "
            "tuning predicted the final runs."
        )
    said = {
        "predicted": "the tuning predicted the final ranking",
        "did not predict": "the tuning did not predict the final ranking",
        "agreed, not significantly": "the tuning's ranking agreed with the final one, not "
        "significantly",
    }[agreement.word]
    return (
        f"epsilon {eps:g}: {said} ({metric} in tuning against {final_metric(metric)} "
        f"over {agreement.items} picks: Spearman {agreement.spearman:.2f} (p = "
        f"{agreement.spearman_p:.2g}), Kendall {agreement.kendall:.2f} (p = "
        f"{agreement.kendall_p:.2g}))."
    )


def _add_transfer_check(
    report: Report, tuning_scores: dict[tuple[str, float], tuple[str, float]]
) -> None:
    checks = transfer_checks(report.runs, tuning_scores)
    if not checks:
        return
    report.blocks.append(Heading("Did the tuning predict the final runs?"))
    for check in checks:
        final = final_metric(check.metric)
        rows = [
            [method, f"{tuning:.4f}", f"{value:.4f}"]
            for method, (tuning, value) in sorted(check.pairs.items(), key=lambda kv: -kv[1][0])
        ]
        seeds = f"mean of the {check.seeds} seed{'s' * (check.seeds != 1)} every pick ran"
        report.blocks += [
            Paragraph(transfer_line(check.epsilon, check.metric, check.agreement)),
            TableBlock(["method", f"{check.metric} (tuning)", f"{final} (final, {seeds})"], rows),
        ]
    report.blocks.append(Paragraph(TRANSFER_NOTE))


def _add_known_setting_check(
    report: Report, checks: Sequence[tuple[float, str, str, Difference]]
) -> None:
    header = ["eps", "tuned pick", "fixed setting", "accuracy difference (points)", "95 % CI",
              "p", "seeds", "verdict"]  # fmt: skip
    rows = [
        [f"{eps:g}", tuned, fixed, *difference_cells(d, 100.0, 1, verdict_word(d, "max"))]
        for eps, tuned, fixed, d in checks
    ]
    report.blocks += [
        Heading("Tuned picks against fixed settings of their optimizer"),
        TableBlock(header, rows),
        Paragraph(KNOWN_SETTING_NOTE),
    ]


# --- the report ------------------------------------------------------------------------------


def _epsilon_text(value: float) -> str:
    return f"{value:,.2f}" if math.isfinite(value) else "inf"


def privacy_lines(table: pd.DataFrame, touched: Mapping[tuple[str, float], str]) -> list[str]:
    """The report's headline on privacy: per epsilon with tuned methods, what their released
    models spend end to end against what their training spent; then the rows of the results
    table with their two epsilons side by side, with what the tuning behind a tuned one
    touched (``touched``: (method, epsilon) -> `dpivon.runs.result.tuning_touched`). Rows
    that would say the same are one line (the parent run's description has a length limit)."""
    said: dict[str, list[str]] = {}  # a line's text after the methods -> its methods
    tuned: dict[float, list[float]] = {}  # epsilon -> its tuned methods' end-to-end epsilons
    for _, row in table.iterrows():
        method, eps = row["method"], row["epsilon"]
        spent, end_to_end = row["epsilon_spent_mean"], row["epsilon_end_to_end_mean"]
        if math.isinf(spent):
            said.setdefault(": not private (no noise), epsilon inf.", []).append(method)
            continue
        if (method, eps) in touched:
            tuned.setdefault(eps, []).append(end_to_end)
        how = touched.get((method, eps), "fixed hyper-parameters, not chosen on these images")
        text = (
            f" (epsilon {eps:g}): training {_epsilon_text(spent)}, end to end "
            f"{_epsilon_text(end_to_end)}; {how}."
        )
        said.setdefault(text, []).append(method)
    headline = []
    for eps, values in sorted(tuned.items()):
        low, high = min(values), max(values)
        spread = _epsilon_text(low) + ("" if low == high else f" to {_epsilon_text(high)}")
        headline.append(
            f"**Epsilon {eps:g} is what each run's training spent.** The tuned methods' "
            f"settings were chosen by tuning on the same training images, so their released "
            f"models spend epsilon {spread} end to end (that tuning composed with the "
            "training by the RDP accountant)."
        )
    rows = [", ".join(f"**{m}**" for m in methods) + text for text, methods in said.items()]
    return headline + rows


def _results_blocks(
    table: pd.DataFrame,
    verdict: list[str],
    settings: Sequence[str],
    failed: dict[str, str],
    privacy: list[str],
) -> list[Block]:
    """The settings, the two epsilons, the verdict, the results table with its notes, the
    failed runs."""
    blocks: list[Block] = [Bullets(list(settings))] if settings else []
    if privacy:
        heading = Heading("Privacy: each run's training and its end-to-end epsilon")
        blocks += [heading, Bullets(privacy)]
    # the report's own list, not a copy: Report.add_verdict adds to what this block shows
    blocks += [Heading("Verdict"), Bullets(verdict), Paragraph(STATISTICS_RULE)]
    blocks += [
        Heading("Results (mean [95 % interval] over seeds)"),
        TableBlock(*results_rows(table)),
        Paragraph(TEMPERATURE_NOTE),
        Paragraph(COLUMN_NOTE),
    ]
    if failed:
        blocks += [
            Paragraph(f"{len(failed)} run(s) failed and are not in the table:"),
            Bullets([f"`{key}`: {message}" for key, message in failed.items()]),
        ]
    return blocks


def _add_metric_curves(report: Report, methods: Sequence[str]) -> None:
    report.figures["metrics_vs_epsilon.png"] = png_bytes(plot_metric_curves(report.table, methods))
    report.blocks += [
        Heading("Metrics versus epsilon"),
        Images(["metrics_vs_epsilon.png"], "Mean over seeds, error bars one std; inf: no noise."),
    ]


def _add_reliability_diagrams(
    report: Report, records: Sequence[RunRecord], methods: Sequence[str]
) -> None:
    """One diagram per method, seeds pooled, at the smallest and largest finite epsilon."""
    report.blocks.append(Heading("Reliability diagrams (test, seeds pooled)"))
    finite = sorted({r.epsilon for r in records if math.isfinite(r.epsilon)})
    for eps in sorted({finite[0], finite[-1]}) if finite else []:
        names = []
        for method in methods:
            diagrams = [
                r.reliability
                for r in records
                if r.method == method and r.epsilon == eps and r.reliability is not None
            ]
            if not diagrams:
                continue
            name = f"reliability_{method}_eps{eps:g}.png"
            title = f"{method}, epsilon {eps:g} ({len(diagrams)} seeds)"
            report.figures[name] = png_bytes(plot_pooled_reliability(diagrams, title))
            names.append(name)
        if names:
            report.blocks.append(Images(names, f"epsilon {eps:g}"))


def _add_diagnostics(report: Report, records: Sequence[RunRecord], methods: Sequence[str]) -> None:
    report.blocks.append(Heading("Curvature-collapse diagnostics over training"))
    figure = plot_diagnostics(records, methods)
    if figure is None:
        report.blocks.append(
            Paragraph("No run logged curvature diagnostics (no IVON-family method).")
        )
        return
    diagnosed = report.table[report.table["last_hess_median_mean"].notna()]
    if not diagnosed.empty:
        report.blocks += [
            TableBlock(*results_rows(diagnosed, _DIAGNOSTIC_COLUMNS)),
            Paragraph(DIAGNOSTICS_NOTE),
        ]
    report.figures["diagnostics.png"] = png_bytes(figure)
    with_diagnostics = {r.method for r in records if r.history}
    without = [m for m in methods if m in {r.method for r in records} - with_diagnostics]
    caption = "Per-epoch values logged by training (`dpivon.optim.dp_ivon.DPIVON`), mean over seeds"
    if without:
        caption += f"; methods without them ({', '.join(without)}) are not drawn"
    report.blocks.append(Images(["diagnostics.png"], caption + "."))


def _add_sweep_fronts(report: Report, sweeps: Sequence[ResultsStorage]) -> None:
    report.blocks.append(Heading("Pareto fronts of the tuning sweeps (validation)"))
    for directory in sweeps:
        name = f"pareto_{directory.name}.png"
        report.figures[name] = pareto_png(directory)
        report.blocks.append(Images([name], f"sweep {directory.name}"))


def _methods_blocks(
    methods: Sequence[str], method_configs: dict[str, dict[str, Any]]
) -> list[Block]:
    """Each method's optimizer, hyper-parameters and where a sweep picked them."""
    rows = []
    for method in methods:
        config = method_configs.get(method)
        if config is None:
            continue
        shown = ", ".join(
            f"{k}={config[k]}" for k in _HYPER_PARAMETERS if config.get(k) is not None
        )
        tuned_by = config.get("tuned_by") or "fixed hyper-parameters"
        dimension = config.get("space_dimension")
        searched = (
            "-"
            if not config.get("tuned_by")
            else ("not recorded" if dimension is None else str(dimension))
        )
        rows.append([method, str(config["optimizer"]), shown, tuned_by, searched])
    header = ["method", "optimizer", "hyper-parameters", "tuned by", "space dimension"]
    return [Heading("Methods"), TableBlock(header, rows)]


def build_report(
    title: str,
    records: Sequence[RunRecord],
    *,
    method_order: Sequence[str] | None = None,
    settings: Sequence[str] = (),
    method_configs: dict[str, dict[str, Any]] | None = None,
    sweeps: Sequence[ResultsStorage] = (),
    failed: dict[str, str] | None = None,
    tuning_scores: dict[tuple[str, float], tuple[str, float]] | None = None,
    tuning_touched: Mapping[tuple[str, float], str] | None = None,
) -> Report:
    """Aggregate ``records`` and lay out the report (figures rendered to PNG here).

    ``method_configs`` maps a method to one of its run configs (its hyper-parameters) and,
    under ``tuned_by``, where a sweep picked it; ``failed`` maps run keys to error lines;
    ``tuning_scores`` maps (method, epsilon) to its pick's (metric, score) in the sweep,
    for the transfer check (its verdict lines join the verdict); ``tuning_touched`` maps
    (method, epsilon) of a tuned method to what its tuning touched (see `privacy_lines`).
    """
    methods = list(method_order or dict.fromkeys(r.method for r in records))
    table = aggregate(records, methods)
    runs = records_frame(records)
    verdict = verdict_lines(runs) if not table.empty else ["no run finished"]
    if not table.empty and tuning_scores:
        verdict += [
            transfer_line(check.epsilon, check.metric, check.agreement)
            for check in transfer_checks(runs, tuning_scores)
        ]
    known = known_setting_checks(runs, known_setting_pairs(method_configs or {}))
    extremes = set(verdict_epsilons(runs))
    verdict += [known_setting_line(*check) for check in known if check[0] in extremes]
    privacy = privacy_lines(table, tuning_touched or {})
    blocks = _results_blocks(table, verdict, settings, failed or {}, privacy)
    report = Report(title, blocks, table, runs, verdict, privacy=privacy)
    if table.empty:
        return report
    differences = difference_rows(runs, methods)
    if differences[1]:
        report.blocks += [
            Heading("Paired differences against the best method (test)"),
            TableBlock(*differences),
            Paragraph(STATISTICS_RULE),
        ]
    _add_metric_curves(report, methods)
    _add_reliability_diagrams(report, records, methods)
    _add_diagnostics(report, records, methods)
    if tuning_scores:
        _add_transfer_check(report, tuning_scores)
    if known:
        _add_known_setting_check(report, known)
    if sweeps:
        _add_sweep_fronts(report, sweeps)
    if method_configs:
        report.blocks += _methods_blocks(methods, method_configs)
    return report


def write_report(report: Report, directory: Path) -> list[Path]:
    """report.md, report.html, the figures and the two CSV tables under ``directory``."""
    figures = directory / FIGURES
    figures.mkdir(parents=True, exist_ok=True)
    (directory / REPORT_MD).write_text(report.markdown())
    (directory / REPORT_HTML).write_text(report.html())
    report.table.to_csv(directory / RESULTS_CSV, index=False)
    report.runs.to_csv(directory / RUNS_CSV, index=False)
    written = [directory / name for name in (REPORT_MD, REPORT_HTML, RESULTS_CSV, RUNS_CSV)]
    for name, data in report.figures.items():
        (figures / name).write_bytes(data)
        written.append(figures / name)
    return written


def log_report(tracker: Tracker, run_id: str, report: Report, files: Sequence[Path]) -> None:
    """The report's files under ``report/``, the aggregated means as metrics, and the table
    with the verdict as the run's description."""
    for path in files:
        sub = f"report/{FIGURES}" if path.parent.name == FIGURES else "report"
        tracker.log_artifact(run_id, path, sub)
    metrics = {}
    for _, row in report.table.iterrows():
        for metric in ("test_accuracy", "test_nll", "test_ece", "test_ts_ece"):
            value = row[f"{metric}_mean"]
            metrics[f"{metric}.eps{row['epsilon']:g}.{row['method']}"] = value
    tracker.log_changed_metrics(run_id, metrics)  # a rebuilt report (--resume) adds none
    tracker.set_tags(run_id, {"mlflow.note.content": report.note()})
