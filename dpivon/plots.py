"""Matplotlib figures of the metrics (dpivon.evaluation.metrics), drawn without pyplot state."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from dpivon.evaluation.metrics import ReliabilityDiagram


def plot_reliability_diagram(diagram: ReliabilityDiagram, title: str = "") -> Figure:
    """Reliability diagram (top) over a confidence histogram (bottom), without pyplot state."""
    fig = Figure(figsize=(5.0, 6.0), layout="constrained")
    ax_rel, ax_hist = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    left = diagram.bin_edges[:-1]
    width = np.diff(diagram.bin_edges)
    filled = diagram.bin_count > 0
    acc = np.where(filled, diagram.bin_accuracy, 0.0)
    conf = np.where(filled, diagram.bin_confidence, 0.0)

    ax_rel.plot([0, 1], [0, 1], ls="--", color="0.4", lw=1, label="Perfect calibration")
    ax_rel.bar(
        left,
        acc,
        width,
        align="edge",
        color="#4C72B0",
        edgecolor="white",
        lw=0.8,
        label="Accuracy",
    )
    # The gap spans accuracy to mean confidence in each bin; ECE is its count-weighted mean.
    ax_rel.bar(
        left[filled],
        np.abs(conf - acc)[filled],
        width[filled],
        bottom=np.minimum(acc, conf)[filled],
        align="edge",
        color="#C44E52",
        alpha=0.35,
        edgecolor="#C44E52",
        hatch="//",
        lw=0.8,
        label=f"Gap (ECE = {100 * diagram.ece:.2f}%)",
    )
    ax_rel.set(xlim=(0, 1), ylim=(0, 1), ylabel="Accuracy")
    ax_rel.set_title(title or "Reliability diagram")
    ax_rel.legend(loc="best", frameon=False)
    ax_rel.grid(alpha=0.3)

    fraction = diagram.bin_count / diagram.num_examples
    ax_hist.bar(left, fraction, width, align="edge", color="0.55", edgecolor="white", lw=0.8)
    ax_hist.axvline(
        diagram.accuracy, color="#4C72B0", lw=1.5, label=f"Accuracy {100 * diagram.accuracy:.1f}%"
    )
    ax_hist.axvline(
        diagram.mean_confidence,
        color="#C44E52",
        ls="--",
        lw=1.5,
        label=f"Mean confidence {100 * diagram.mean_confidence:.1f}%",
    )
    ax_hist.set(xlim=(0, 1), xlabel="Confidence", ylabel="Fraction of examples")
    ax_hist.legend(loc="best", frameon=False, fontsize="small")
    ax_hist.grid(alpha=0.3)
    return fig
