"""The benchmark report's blocks on uncertainty under dataset shift (`dpivon.shift`): accuracy
and ECE against corruption severity per method, as Ovadia et al. (NeurIPS 2019) plot them,
and the selective-prediction and error-detection table. They read the ``test_shift_s<k>_*``
metrics that a benchmark with ``shift: default`` (or ``full``) logs for each run; a run
without them is left out, and a report with none says how to get them.

Kept apart from `dpivon.study.benchmark_report`, which calls `add_shift_blocks` once: the
numbers here are means over seeds with their 95 % intervals, like the results table's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from dpivon.study.aggregate import RunRecord, seed_summary
from dpivon.study.benchmark_report import (
    Block,
    Heading,
    Images,
    Paragraph,
    Report,
    TableBlock,
    mean_with_interval,
)
from dpivon.study.figures import png_bytes

SHIFT_PREFIX = "test_shift_s"
SEVERITY_LEVELS = (0, 1, 2, 3, 4, 5)  # 0: the clean images of the shift set
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
    "Selective prediction (`dpivon.selective`): AURC, the mean error rate over all coverages "
    "when the least certain predictions are set aside first (lower is better), and the "
    "accuracy of the 90 % and 80 % most certain predictions, by max-probability; error "
    "detection: the AUROC of telling wrong predictions from right ones by 1 - max-probability, "
    "the predictive entropy and (IVON family) the mutual information across posterior draws "
    "(0.5: no better than chance). Mean over seeds [95 % interval]."
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


def plot_shift(table: pd.DataFrame, methods: Sequence[str]) -> Figure:
    """Accuracy, ECE and NLL against severity, one row of panels per epsilon, one line per
    method (mean over seeds, error bars its 95 % interval)."""
    epsilons = sorted(set(table["epsilon"]))
    fig = Figure(figsize=(4.0 * len(SHIFT_PANELS), 3.2 * len(epsilons)), layout="constrained")
    axes = fig.subplots(len(epsilons), len(SHIFT_PANELS), squeeze=False)
    for row, epsilon in enumerate(epsilons):
        for col, (metric, title) in enumerate(SHIFT_PANELS):
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


def add_shift_blocks(report: Report, records: Sequence[RunRecord], methods: Sequence[str]) -> None:
    """The shift figure, accuracy and ECE by severity, and the selective-prediction table."""
    blocks: list[Block] = [Heading("Uncertainty under dataset shift")]
    shifted = shifted_records(records)
    if not shifted:
        report.blocks += [*blocks, Paragraph(NO_SHIFT_NOTE)]
        return
    table = shift_table(shifted, methods)
    report.figures["shift.png"] = png_bytes(plot_shift(table, methods))
    by_severity = ["method", "eps", "seeds", "clean", "1", "2", "3", "4", "5"]
    blocks += [
        Images(["shift.png"], "Mean over seeds, error bars: 95 % interval (Ovadia et al. 2019)."),
        Paragraph(SHIFT_NOTE),
        Paragraph("ECE against severity (mean over seeds [95 % interval]):"),
        TableBlock(by_severity, severity_rows(table, "ece", 1.0, 3)),
        Paragraph("Accuracy % against severity (mean over seeds [95 % interval]):"),
        TableBlock(by_severity, severity_rows(table, "accuracy", 100.0, 1)),
        Heading("Selective prediction and error detection", level=3),
        TableBlock(*selective_rows(table)),
        Paragraph(SELECTIVE_NOTE),
    ]
    report.blocks += blocks
