"""The benchmark report's figures: metrics versus epsilon per method (mean, error bars one
std over seeds), reliability diagrams pooled over seeds (`dpivon.evaluation.metrics`), the
curvature-collapse diagnostics over training, and a tuning sweep's Pareto fronts
(`dpivon.search.pareto_views`)."""

from __future__ import annotations

import io
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from dpivon.evaluation.metrics import ReliabilityDiagram
from dpivon.orchestration.storage import ResultsStorage
from dpivon.plots import plot_reliability_diagram
from dpivon.study.aggregate import RunRecord, pooled_reliability

_CURVES = (
    ("test_accuracy", "test accuracy"),
    ("test_nll", "test NLL"),
    ("test_ece", "test ECE"),
    ("test_ts_ece", "test ECE after temperature scaling"),
)
# (median key, band keys or None, title): one row of the diagnostics figure each
_DIAGNOSTIC_ROWS = (
    ("projected_fraction", None, "share of v_hat projected to 0"),
    ("hess_median", ("hess_q10", "hess_q90"), "h: median, q10-q90 band"),
    (
        "posterior_std_median",
        ("posterior_std_q10", "posterior_std_q90"),
        "posterior std: median, q10-q90 band",
    ),
    ("clamped_noise_share_median", None, "share of h clamped noise alone gives (median)"),
    ("grad_snr_median", None, "SNR of g_dp per tensor (median)"),
    ("curvature_update_share", None, "curvature's share of the update"),
    (
        "curvature_learned_share_median",
        ("curvature_learned_share_q10", "curvature_learned_share_q90"),
        "learned share of h: median, q10-q90 band",
    ),
    ("curvature_horizon_share", None, "horizon share of h (1 - beta2^t)"),
)


def png_bytes(figure: Figure) -> bytes:
    """The figure as PNG file contents (the report embeds or writes them)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


def _epsilon_axis(epsilons: Sequence[float]) -> dict[float, float]:
    """x position of each epsilon on a log axis; inf sits one step right of the largest."""
    finite = sorted(e for e in epsilons if math.isfinite(e))
    positions = {e: e for e in finite}
    if any(math.isinf(e) for e in epsilons):
        positions[math.inf] = finite[-1] * 4.0 if finite else 1.0
    return positions


def plot_metric_curves(table: pd.DataFrame, methods: Sequence[str]) -> Figure:
    """Accuracy, NLL, ECE and tempered ECE versus epsilon; error bars one std over seeds."""
    positions = _epsilon_axis(table["epsilon"].tolist())
    fig = Figure(figsize=(4.0 * len(_CURVES), 3.8), layout="constrained")
    axes = fig.subplots(1, len(_CURVES))
    for ax, (metric, title) in zip(axes, _CURVES, strict=True):
        for i, method in enumerate(methods):
            rows = table[table["method"] == method]
            if rows.empty:
                continue
            jitter = 1.0 + 0.04 * (i - (len(methods) - 1) / 2)  # keeps error bars apart
            x = [positions[e] * jitter for e in rows["epsilon"]]
            ax.errorbar(
                x,
                rows[f"{metric}_mean"],
                yerr=rows[f"{metric}_std"].fillna(0.0),
                marker="o",
                ms=4,
                capsize=3,
                label=method,
                color=f"C{i % 10}",
            )
        ax.set_xscale("log")
        ax.set_xticks(list(positions.values()), [f"{e:g}" for e in positions])
        ax.minorticks_off()
        ax.set(title=title, xlabel="epsilon")
        ax.grid(alpha=0.3)
    axes[0].legend(frameon=False, fontsize="small")
    return fig


def _curves(records: Sequence[RunRecord], key: str) -> np.ndarray | None:
    """Seeds x epochs of one history key (cut to the shortest), None if no record has it."""
    series = [r.history[key] for r in records if r.history.get(key)]
    if not series:
        return None
    length = min(len(s) for s in series)
    return np.array([s[:length] for s in series], dtype=np.float64)


def plot_diagnostics(records: Sequence[RunRecord], methods: Sequence[str]) -> Figure | None:
    """The collapse diagnostics over training: one row per logged diagnostic, one column per
    epsilon, one line per method (mean over seeds; band: mean q10-q90, or ± one std)."""
    rows = [r for r in _DIAGNOSTIC_ROWS if any(r[0] in rec.history for rec in records)]
    epsilons = sorted({r.epsilon for r in records if r.history})
    if not rows or not epsilons:
        return None
    fig = Figure(figsize=(3.6 * len(epsilons) + 1.8, 2.5 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), len(epsilons), squeeze=False, sharex=True)
    for col, eps in enumerate(epsilons):
        for row, (key, band, title) in enumerate(rows):
            ax = axes[row][col]
            positive = True
            for i, method in enumerate(methods):
                group = [r for r in records if r.method == method and r.epsilon == eps]
                values = _curves(group, key)
                if values is None:
                    continue
                epochs = np.arange(1, values.shape[1] + 1)
                mean = values.mean(axis=0)
                if band is not None:
                    low, high = (_curves(group, k) for k in band)
                    low = low.mean(axis=0)[: len(mean)] if low is not None else mean
                    high = high.mean(axis=0)[: len(mean)] if high is not None else mean
                else:
                    std = values.std(axis=0, ddof=1) if len(values) > 1 else 0.0 * mean
                    low, high = mean - std, mean + std
                colour = f"C{i % 10}"
                ax.plot(epochs, mean, marker="o", ms=3, color=colour, label=method)
                ax.fill_between(epochs, low, high, color=colour, alpha=0.15, lw=0)
                positive = positive and bool(np.all(np.concatenate([low, mean]) > 0))
            if key in ("hess_median", "posterior_std_median", "grad_snr_median") and positive:
                ax.set_yscale("log")
            else:
                ax.ticklabel_format(axis="y", useOffset=False)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"epsilon {eps:g}")
            if col == 0:
                ax.set_ylabel(title, fontsize="small")
            if row == len(rows) - 1:
                ax.set_xlabel("epoch")
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles, labels = {}, {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
            labels[label] = label
    fig.legend(list(handles.values()), list(labels), loc="outside right center", frameon=False)
    return fig


def pareto_png(directory: ResultsStorage) -> bytes:
    """The Pareto-front plot of a finished sweep (the one a tuned method came from)."""
    from dpivon.search.export import load_results
    from dpivon.search.pareto_views import plot_fronts_png
    from dpivon.search.sweep import SweepState

    state = SweepState.load(directory)
    trials, _ = load_results(directory)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pareto.png"
        plot_fronts_png(trials, state.objectives, path, f"sweep {state.name}: fronts on validation")
        return path.read_bytes()


def plot_pooled_reliability(diagrams: Sequence[ReliabilityDiagram], title: str) -> Figure:
    """The reliability diagram of several seeds' test predictions together."""
    return plot_reliability_diagram(pooled_reliability(diagrams), title)
