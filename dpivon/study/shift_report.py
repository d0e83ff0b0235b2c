"""The benchmark report's blocks on uncertainty under dataset shift
(`dpivon.evaluation.shift`): accuracy and ECE against corruption severity per method, as
Ovadia et al. (NeurIPS 2019) plot them, and the selective-prediction and error-detection
table. They read the ``test_shift_s<k>_*`` metrics that a benchmark with ``shift: default``
(or ``full``) logs for each run; a run without them is left out, and a report with none says
how to get them.

Where the benchmark names each private method's non-private ``reference``, the section ends
with what privacy costs under shift: per seed, the accuracy privacy takes and the ECE and
NLL it adds at each severity against the reference (same replicate), their 95 % intervals,
and the methods' costs compared: against the least cost, and between every two methods of
different references (does DP-IVON-Gradsq keep more of IVON's calibration than DP-Adam keeps
of Adam's?), in the verdict's words.

Kept apart from `dpivon.study.benchmark_report`; `dpivon.study.benchmark` calls
`add_shift_blocks` once per report: the numbers here are means over seeds with their 95 %
intervals, like the results table's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from dpivon.evaluation.shift import ShiftSet
from dpivon.study.aggregate import (
    RunRecord,
    compare,
    seed_summary,
    seed_values,
    verdict_epsilons,
)
from dpivon.study.benchmark_report import Report
from dpivon.study.figures import png_bytes
from dpivon.study.report_blocks import Block, Heading, Images, Paragraph, TableBlock
from dpivon.study.report_numbers import (
    STATISTICS_RULE,
    comparison_text,
    difference_cells,
    difference_rows,
    mean_with_interval,
)
from dpivon.study.significance import holm_adjusted, seed_difference, verdict_word

SHIFT_PREFIX = "test_shift_s"
SEVERITY_LEVELS = (0, 1, 2, 3, 4, 5)  # 0: the clean images of the shift set
SEVERITY_HEADER = ("method", "eps", "seeds", "clean", "1", "2", "3", "4", "5")
# the figure's panels: (metric, title)
SHIFT_PANELS = (("accuracy", "accuracy"), ("ece", "ECE"), ("nll", "NLL"))
# the selective-prediction table: (metric, header, scale, decimals)
SELECTIVE_COLUMNS = (
    ("accuracy", "accuracy %", 100.0, 1),
    ("aurc_maxprob", "AURC", 1.0, 3),
    ("acc_at_90_maxprob", "acc. % at 90 % coverage", 100.0, 1),
    ("acc_at_80_maxprob", "acc. % at 80 % coverage", 100.0, 1),
    ("auroc_maxprob", "AUROC max-p", 1.0, 3),
    ("auroc_entropy", "AUROC entropy", 1.0, 3),
    ("auroc_mi", "AUROC MI", 1.0, 3),
)
SELECTIVE_SEVERITIES = (0, 3)  # clean, and the middle of CIFAR-10-C's range
SHIFT_NOTE = (
    "Severity 0 is the shift set's clean test images; severities 1-5 the mean over its "
    "corruptions (CIFAR-10-C's, made by `dpivon.data.corruptions`) at that severity. Every "
    "set is predicted with the run's own predictive (BMA for the IVON family)."
)
SELECTIVE_NOTE = (
    "Selective prediction (`dpivon.evaluation.selective`): AURC, the mean error rate over "
    "all coverages "
    "when the least certain predictions are set aside first (lower is better), and the "
    "accuracy of the 90 % and 80 % most certain predictions, by max-probability; error "
    "detection: the AUROC of telling wrong predictions from right ones by 1 - max-probability, "
    "the predictive entropy and (IVON family) the mutual information across posterior draws "
    "(0.5: no better than chance). Mean over seeds [95 % interval]."
)
# What privacy costs under shift: how much worse a private run is than its reference (same
# replicate), so that a smaller cost is better for every metric: +1 the private run's value
# minus the reference's (ECE, NLL), -1 the reverse (accuracy: the points lost)
COST_SIGNS = {"accuracy": -1.0, "ece": 1.0, "nll": 1.0}
COST_PANELS = (
    ("accuracy_cost", "accuracy lost to privacy"),
    ("ece_cost", "ECE added by privacy"),
    ("nll_cost", "NLL added by privacy"),
)
# the cost tables by severity: (metric, caption, scale, decimals)
COST_TABLES = (
    ("ece", "ECE added by privacy (private minus reference) against severity:", 1.0, 3),
    ("accuracy", "Accuracy lost to privacy (reference minus private, points) against "
     "severity:", 100.0, 1),
    ("nll", "NLL added by privacy (private minus reference) against severity:", 1.0, 3),
)  # fmt: skip
# the costs compared between methods: (column, label, scale, decimals)
COST_DIFFERENCES = (
    ("ece_cost_s3", "ECE added at severity 3", 1.0, 3),
    ("ece_cost_shifted", "ECE added, mean of severities 1-5", 1.0, 3),
    ("accuracy_cost_s3", "accuracy lost at severity 3 (points)", 100.0, 1),
)
CROSS_REFERENCE_NOTE = (
    "Does a method keep more of its reference's calibration than a method of another "
    "reference keeps of its own (DP-IVON-Gradsq of IVON's against DP-Adam of Adam's)? Every "
    "pair of methods whose references differ: the first method's ECE added at severity 3 "
    'minus the second\'s, seed by seed; "leads": the first loses less calibration to '
    "privacy. p (Holm) adjusts for the pairs of the epsilon."
)
COST_NOTE = (
    "What privacy costs under shift: each private method against the non-private method the "
    "benchmark names as its `reference`, seed k of the one beside seed k of the other (the "
    "replicates are independent, so the pairing is valid; it does not reduce the variance): "
    "the ECE and NLL privacy adds and the accuracy it takes, at each severity. A cost near 0 "
    "means privacy took little from the method; methods are then compared by their costs, "
    "so that DP-IVON-Gradsq is measured against IVON and DP-Adam against Adam. Where the "
    "reference is another optimizer's non-private version (DP-SGD against Adam), the cost "
    "also holds the difference of the two optimizers. Mean over seeds [95 % interval]; a "
    "mean is missing where a run did not log that metric."
)
NO_PAIR_NOTE = (
    "No private method has a finished run beside a finished run of its `reference` with the "
    "same seed, both scored under shift: what privacy costs under shift is not measured yet."
)
NO_SHIFT_NOTE = (
    "No run of this benchmark was scored under dataset shift: set `shift: default` in the "
    "benchmark file (or score a saved model with `dpivon evaluate`)."
)


def shift_key(severity: int, metric: str) -> str:
    return f"{SHIFT_PREFIX}{severity}_{metric}"


def shifted_records(records: Sequence[RunRecord]) -> list[RunRecord]:
    """The runs that logged shift metrics."""
    return [r for r in records if shift_key(0, "accuracy") in r.metrics]


def shift_table(records: Sequence[RunRecord], methods: Sequence[str]) -> pd.DataFrame:
    """One row per (method, epsilon, severity): ``n`` seeds and the
    :func:`~dpivon.study.aggregate.seed_summary` of every shift metric logged."""
    metrics = sorted(
        {k.split("_", 3)[3] for r in records for k in r.metrics if k.startswith(SHIFT_PREFIX)}
    )
    rows = []
    for method in methods:
        epsilons = sorted({r.epsilon for r in records if r.method == method})
        for epsilon in epsilons:
            group = [r for r in records if r.method == method and r.epsilon == epsilon]
            for severity in SEVERITY_LEVELS:
                row: dict[str, object] = {
                    "method": method, "epsilon": epsilon, "severity": severity, "n": len(group),
                }  # fmt: skip
                for metric in metrics:
                    values = np.array(
                        [r.metrics.get(shift_key(severity, metric), math.nan) for r in group]
                    )
                    row |= seed_summary(metric, values)
                rows.append(row)
    return pd.DataFrame(rows)


def plot_shift(
    table: pd.DataFrame,
    methods: Sequence[str],
    panels: Sequence[tuple[str, str]] = SHIFT_PANELS,
    zero_line: bool = False,
) -> Figure:
    """``panels`` (metric, title; accuracy, ECE and NLL) against severity, one row of panels
    per epsilon, one line per method (mean over seeds, error bars its 95 % interval);
    ``zero_line`` marks 0 (for differences)."""
    epsilons = sorted(set(table["epsilon"]))
    fig = Figure(figsize=(4.0 * len(panels), 3.2 * len(epsilons)), layout="constrained")
    axes = fig.subplots(len(epsilons), len(panels), squeeze=False)
    for row, epsilon in enumerate(epsilons):
        for col, (metric, title) in enumerate(panels):
            ax = axes[row][col]
            for i, method in enumerate(methods):
                rows = table[(table["method"] == method) & (table["epsilon"] == epsilon)]
                logged = f"{metric}_mean" in rows and rows[f"{metric}_mean"].notna().any()
                if not logged:
                    continue
                offset = 0.06 * (i - (len(methods) - 1) / 2)  # keeps error bars apart
                ax.errorbar(
                    rows["severity"] + offset,
                    rows[f"{metric}_mean"],
                    yerr=[
                        (rows[f"{metric}_mean"] - rows[f"{metric}_ci_low"]).fillna(0.0),
                        (rows[f"{metric}_ci_high"] - rows[f"{metric}_mean"]).fillna(0.0),
                    ],
                    marker="o", ms=4, capsize=3, label=method, color=f"C{i % 10}",
                )  # fmt: skip
            if zero_line:
                ax.axhline(0.0, color="0.4", lw=0.8, ls="--")
            ax.set_xticks(list(SEVERITY_LEVELS), ["clean", "1", "2", "3", "4", "5"])
            ax.set(title=f"{title}, epsilon {epsilon:g}", xlabel="corruption severity")
            ax.grid(alpha=0.3)
    axes[0][0].legend(frameon=False, fontsize="small")
    return fig


def severity_rows(table: pd.DataFrame, metric: str, scale: float, decimals: int) -> list[list[str]]:
    """Per (method, epsilon): the metric's mean [95 % interval] at each severity."""
    rows = []
    for (method, epsilon), group in table.groupby(["method", "epsilon"], sort=False):
        cells = [
            mean_with_interval(
                r[f"{metric}_mean"], r[f"{metric}_ci_low"], r[f"{metric}_ci_high"], scale, decimals
            )
            for _, r in group.sort_values("severity").iterrows()
        ]
        rows.append([str(method), f"{epsilon:g}", str(int(group["n"].iloc[0])), *cells])
    return rows


def selective_rows(table: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the selective-prediction table: per (method, epsilon) and shift
    (clean, severity 3), the columns of `SELECTIVE_COLUMNS` that some run logged."""
    columns = [c for c in SELECTIVE_COLUMNS if f"{c[0]}_mean" in table]
    header = ["method", "eps", "seeds", "shift", *(h for _, h, _, _ in columns)]
    rows = []
    for _, row in table[table["severity"].isin(SELECTIVE_SEVERITIES)].iterrows():
        shift = "clean" if row["severity"] == 0 else f"severity {row['severity']}"
        cells = [
            mean_with_interval(row[f"{m}_mean"], row[f"{m}_ci_low"], row[f"{m}_ci_high"], s, d)
            for m, _, s, d in columns
        ]
        rows.append([str(row["method"]), f"{row['epsilon']:g}", str(int(row["n"])), shift, *cells])
    return header, rows


def privacy_cost_frame(records: Sequence[RunRecord], references: Mapping[str, str]) -> pd.DataFrame:
    """One row per run of a private method in ``references`` (method -> its non-private
    reference) whose reference ran the same replicate: method, epsilon, replicate and, per
    metric of COST_SIGNS, ``<metric>_cost_s<k>`` (how much worse the run is than its
    reference at severity k; 0: the clean set) and ``<metric>_cost_shifted`` (the mean over
    severities 1-5). ``records`` are runs scored under shift."""
    reference_runs = {(r.method, r.replicate): r for r in records if math.isinf(r.epsilon)}
    rows = []
    for run in records:
        reference = reference_runs.get((references.get(run.method), run.replicate))
        if reference is None:
            continue
        row: dict[str, object] = {
            "method": run.method, "epsilon": run.epsilon, "replicate": run.replicate,
        }  # fmt: skip
        for metric, sign in COST_SIGNS.items():
            costs = [
                sign
                * (
                    run.metrics.get(shift_key(k, metric), math.nan)
                    - reference.metrics.get(shift_key(k, metric), math.nan)
                )
                for k in SEVERITY_LEVELS
            ]
            row |= {f"{metric}_cost_s{k}": c for k, c in zip(SEVERITY_LEVELS, costs, strict=True)}
            row[f"{metric}_cost_shifted"] = float(np.mean(costs[1:]))
        rows.append(row)
    columns = ["method", "epsilon", "replicate"] + [
        f"{metric}_cost_{level}"
        for metric in COST_SIGNS
        for level in [*(f"s{k}" for k in SEVERITY_LEVELS), "shifted"]
    ]
    return pd.DataFrame(rows, columns=columns)


def cost_table(
    costs: pd.DataFrame, methods: Sequence[str], references: Mapping[str, str]
) -> pd.DataFrame:
    """:func:`shift_table`'s layout for the costs: one row per (method, epsilon, severity),
    the method labelled ``<method> vs <reference>``, and the seed summary of each
    ``<metric>_cost``."""
    rows = []
    for method in methods:
        for epsilon in sorted(set(costs.loc[costs["method"] == method, "epsilon"])):
            group = costs[(costs["method"] == method) & (costs["epsilon"] == epsilon)]
            for severity in SEVERITY_LEVELS:
                row: dict[str, object] = {
                    "method": f"{method} vs {references[method]}", "epsilon": epsilon,
                    "severity": severity, "n": len(group),
                }  # fmt: skip
                for metric in COST_SIGNS:
                    values = group[f"{metric}_cost_s{severity}"].to_numpy(dtype=np.float64)
                    row |= seed_summary(f"{metric}_cost", values)
                rows.append(row)
    return pd.DataFrame(rows)


def privacy_cost_verdict(costs: pd.DataFrame) -> list[str]:
    """Per extreme epsilon: which method's ECE at severity 3 rises least over its
    reference's, and whether that leads the runner-up or is indistinguishable from it."""
    lines = []
    for eps in verdict_epsilons(costs):
        text = comparison_text(compare(costs, "ece_cost_s3", eps, "min"), 1.0, 3, "")
        if text is not None:
            lines.append(
                f"epsilon {eps:g}, under shift (severity 3): least ECE added by privacy "
                f"(ECE minus its non-private reference's, seed by seed) {text}."
            )
    return lines


def cross_reference_rows(
    costs: pd.DataFrame, methods: Sequence[str], references: Mapping[str, str]
) -> tuple[list[str], list[list[str]]]:
    """Every pair of ``methods`` whose references differ (the earlier reference's method
    first, references ordered as the methods name them), their ECE added at severity 3
    compared by seed, Holm-adjusted over the pairs of each epsilon."""
    header = ["eps", "method", "other method", "difference of ECE added at severity 3",
              "95 % CI", "p", "p (Holm)", "seeds", "verdict"]  # fmt: skip
    order = list(dict.fromkeys(references[m] for m in methods))
    rows = []
    for eps in sorted(set(costs["epsilon"])):
        costs_by_method = {m: seed_values(costs, m, eps, "ece_cost_s3") for m in methods}
        present = [m for m, v in costs_by_method.items() if np.isfinite(list(v.values())).any()]
        pairs = [
            (first, second)
            for first in present
            for second in present
            if order.index(references[first]) < order.index(references[second])
        ]
        family = [seed_difference(costs_by_method[a], costs_by_method[b]) for a, b in pairs]
        adjusted = holm_adjusted([d.p_value for d in family])
        for (first, second), d, holm in zip(pairs, family, adjusted, strict=True):
            cells = difference_cells(d, 1.0, 3, verdict_word(d, "min"), holm)
            rows.append([
                f"{eps:g}", f"{first} vs {references[first]}",
                f"{second} vs {references[second]}", *cells,
            ])  # fmt: skip
    return header, rows


def _add_privacy_cost(
    report: Report,
    shifted: Sequence[RunRecord],
    methods: Sequence[str],
    references: Mapping[str, str],
) -> None:
    """The cost section's blocks, its figure, and its verdict lines."""
    report.blocks.append(Heading("What privacy costs under shift", level=3))
    costs = privacy_cost_frame(shifted, references)
    if costs.empty:
        report.blocks.append(Paragraph(NO_PAIR_NOTE))
        return
    costed = [m for m in methods if m in set(costs["method"])]
    table = cost_table(costs, costed, references)
    labels = list(dict.fromkeys(table["method"]))
    figure = plot_shift(table, labels, COST_PANELS, zero_line=True)
    report.figures["privacy_cost.png"] = png_bytes(figure)
    report.add_verdict(privacy_cost_verdict(costs))
    report.blocks += [
        Images(
            ["privacy_cost.png"],
            "How much worse each private method is than its non-private reference, mean "
            "over seeds, error bars: 95 % interval (0: privacy cost nothing).",
        ),
        Paragraph(COST_NOTE),
    ]
    for metric, caption, scale, decimals in COST_TABLES:
        rows = severity_rows(table, f"{metric}_cost", scale, decimals)
        report.blocks += [Paragraph(caption), TableBlock(list(SEVERITY_HEADER), rows)]
    header, rows = difference_rows(
        costs, costed, COST_DIFFERENCES, {column: "min" for column, *_ in COST_DIFFERENCES}
    )
    if rows:
        report.blocks += [
            Paragraph("The costs compared, against the method privacy cost least:"),
            TableBlock(header, rows),
            Paragraph(STATISTICS_RULE),
        ]
    header, rows = cross_reference_rows(costs, costed, references)
    if rows:
        report.blocks += [Paragraph(CROSS_REFERENCE_NOTE), TableBlock(header, rows)]


def shift_set_text(shift_set: ShiftSet) -> str:
    """Which images and corruptions a shift set scores, and what its intervals leave out."""
    corruptions = ", ".join(f"`{c}`" for c in shift_set.corruptions)
    if shift_set.per_class is None:
        return f"Scored on every test image under {corruptions}."
    return (
        f"Scored on a fixed class-stratified subset of the test set, {shift_set.per_class} "
        f"images per class, under {corruptions}; the results table's test metrics are on "
        "every test image. Every run sees the same subset, so its sampling error (the standard "
        "error sqrt(p (1 - p) / n) of an accuracy p on n images: 2.2 points for 58 % on 500) "
        "is shared by all seeds and methods and is not in the intervals: they compare the "
        "methods on these images."
    )


def add_shift_blocks(
    report: Report,
    records: Sequence[RunRecord],
    methods: Sequence[str],
    references: Mapping[str, str] | None = None,
    shift_set: ShiftSet | None = None,
) -> None:
    """The shift figure, accuracy and ECE by severity, the selective-prediction table and,
    where private methods name their non-private ``references`` (method -> reference),
    what privacy costs under shift (its lines join the verdict). ``shift_set``: the set the
    runs were scored on, said beside the figure."""
    blocks: list[Block] = [Heading("Uncertainty under dataset shift")]
    shifted = shifted_records(records)
    if not shifted:
        report.blocks += [*blocks, Paragraph(NO_SHIFT_NOTE)]
        return
    table = shift_table(shifted, methods)
    report.figures["shift.png"] = png_bytes(plot_shift(table, methods))
    blocks += [
        Images(["shift.png"], "Mean over seeds, error bars: 95 % interval (Ovadia et al. 2019)."),
        Paragraph(SHIFT_NOTE),
        *([Paragraph(shift_set_text(shift_set))] if shift_set is not None else []),
        Paragraph("ECE against severity (mean over seeds [95 % interval]):"),
        TableBlock(list(SEVERITY_HEADER), severity_rows(table, "ece", 1.0, 3)),
        Paragraph("Accuracy % against severity (mean over seeds [95 % interval]):"),
        TableBlock(list(SEVERITY_HEADER), severity_rows(table, "accuracy", 100.0, 1)),
        Heading("Selective prediction and error detection", level=3),
        TableBlock(*selective_rows(table)),
        Paragraph(SELECTIVE_NOTE),
    ]
    report.blocks += blocks
    if references:
        _add_privacy_cost(report, shifted, methods, references)
