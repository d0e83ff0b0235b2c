"""How a sweep's Pareto fronts are shown: a PNG (matplotlib), an interactive HTML page
(plotly) and a terminal table (rich).

Both plots draw the layers of one ``_Plot``: one panel per epsilon, one layer per (panel,
optimizer) with its trials by outcome, its front as a step line and its knee; the fronts
and knees come from :mod:`dpivon.search.pareto`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from dpivon.search.pareto import (
    COMPLETED,
    EARLY_STOPPED,
    FAILED,
    Objectives,
    check_columns,
    check_objectives,
    knee_point,
    pareto_front,
)

_METRIC_PREFIX = ("val_", "test_", "train_")  # metric columns: not shown as hyper-parameters


def _epsilon_title(eps: Any) -> str:
    if eps is None:
        return "all trials"
    try:
        value = float(eps)
    except (TypeError, ValueError):
        return f"epsilon = {eps}"
    if math.isnan(value):
        return "epsilon unknown"
    if math.isinf(value):
        return "non-private (epsilon = inf)"
    return f"epsilon = {value:g}"


def _fmt(value: Any) -> str:
    if isinstance(value, float | np.floating):
        return "nan" if np.isnan(value) else f"{value:.4g}"
    return str(value)


@dataclass
class _Points:
    """Rows drawn as one marker set: coordinates, a trace label and (lazily) hover text."""

    label: str
    rows: pd.DataFrame
    metrics: list[str]
    hover_prefix: str = ""

    @property
    def xy(self) -> tuple[np.ndarray, np.ndarray]:
        return self.rows[self.metrics[0]].to_numpy(), self.rows[self.metrics[1]].to_numpy()

    @cached_property
    def hover(self) -> list[str]:
        """Trial id, group, status, objectives and hyper-parameters (no other metrics)."""
        lead = [c for c in ("trial_id", "optimizer", "epsilon", "status") if c in self.rows]
        skip = {*lead, *self.metrics}
        params = [c for c in self.rows if c not in skip and not str(c).startswith(_METRIC_PREFIX)]
        columns = [*lead, *self.metrics, *params]
        text = (
            zip(columns, row, strict=True) for row in self.rows[columns].itertuples(index=False)
        )
        return [self.hover_prefix + "<br>".join(f"{c}: {_fmt(v)}" for c, v in t) for t in text]


@dataclass
class _Layer:
    """What one optimizer contributes to one epsilon panel, for any renderer.

    ``markers`` maps a kind to its points: ``completed``, ``early_stopped``, ``failed`` (every
    other status), ``front`` (best first objective first; may be empty) and ``knee`` (one row,
    or none without a front); ``steps`` is the front's attainment step line.
    """

    col: int  # panel index, 0-based
    name: str  # optimizer
    colour: int  # index into the renderer's palette
    legend: bool  # the first front of this optimizer: name it in the legend here
    markers: dict[str, _Points]
    steps: tuple[np.ndarray, np.ndarray]


class _Plot:
    """One panel per epsilon, one layer per (panel, optimizer): shared by both renderers."""

    def __init__(self, trials: pd.DataFrame, objectives: Objectives) -> None:
        self.metrics, self.modes = check_objectives(objectives)
        check_columns(trials, ["status", *self.metrics])
        self.objectives = objectives
        trials = trials.drop(columns=["on_front"], errors="ignore")
        panels = []
        if "epsilon" in trials.columns:
            panels = list(trials.groupby("epsilon", sort=True, dropna=False))
        self.panels: list[tuple[Any, pd.DataFrame]] = panels or [(None, trials)]
        self.optimizers = ["trials"]
        if "optimizer" in trials.columns:
            self.optimizers = sorted(trials["optimizer"].astype(str).unique())
        self.titles = [_epsilon_title(eps) for eps, _ in self.panels]
        better = {"max": "higher", "min": "lower"}
        self.axis_labels = [
            f"{m} ({better[d]} is better)" for m, d in zip(self.metrics, self.modes, strict=True)
        ]

    def layers(self) -> Iterator[_Layer]:
        named: set[str] = set()
        for col, (_, panel) in enumerate(self.panels):
            for i, name in enumerate(self.optimizers):
                rows = panel
                if "optimizer" in panel.columns:
                    rows = panel[panel["optimizer"].astype(str) == name]
                status = rows["status"]
                kind = status.where(status.isin([COMPLETED, EARLY_STOPPED]), FAILED)
                markers = {
                    k: _Points(f"{name} ({k})", rows[kind == k], self.metrics)
                    for k in (COMPLETED, EARLY_STOPPED, FAILED)
                }
                front = pareto_front(rows, self.objectives)
                knee = front.loc[[knee_point(front, self.objectives)]] if len(front) else front
                markers["front"] = _Points(name, front, self.metrics)
                markers["knee"] = _Points(f"{name} knee", knee, self.metrics, "knee<br>")
                # Sorted best-first, the front steps from each point along the first
                # objective to the next point, then along the second.
                v = front[self.metrics].to_numpy(dtype=np.float64)
                steps = (np.repeat(v[:, 0], 2)[1:], np.repeat(v[:, 1], 2)[:-1])
                legend = len(front) > 0 and name not in named
                if legend:
                    named.add(name)
                yield _Layer(col, name, i, legend, markers, steps)


# --------------------------------------------------------------------------- renderers

_PNG_MARKERS: dict[str, dict[str, Any]] = {
    COMPLETED: {"s": 22, "alpha": 0.35, "linewidths": 0},
    EARLY_STOPPED: {"s": 22, "alpha": 0.5, "facecolors": "none"},
    FAILED: {"s": 18, "alpha": 0.35, "marker": "x"},
    "front": {"s": 30, "edgecolors": "k", "linewidths": 0.5, "zorder": 3},
    "knee": {"s": 220, "marker": "*", "edgecolors": "k", "linewidths": 0.8, "zorder": 4},
}
_HTML_MARKERS: dict[str, dict[str, Any]] = {
    COMPLETED: {"opacity": 0.45, "size": 7, "symbol": "circle"},
    EARLY_STOPPED: {"opacity": 0.45, "size": 7, "symbol": "circle-open"},
    FAILED: {"opacity": 0.45, "size": 7, "symbol": "x"},
    "knee": {"size": 16, "symbol": "star", "line": {"color": "black", "width": 1}},
}


def plot_fronts_png(
    trials: pd.DataFrame, objectives: Objectives, path: str | Path, title: str
) -> None:
    """Static PNG: one panel per epsilon, all trials faint (filled completed, hollow
    early-stopped, x failed), each optimizer's front as a step line, its knee as a star."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    plot = _Plot(trials, objectives)
    colours = [f"C{i % 10}" for i in range(len(plot.optimizers))]
    fig = Figure(figsize=(5.2 * len(plot.panels) + 2.2, 4.8), layout="constrained")
    axes = fig.subplots(1, len(plot.panels), squeeze=False)[0]
    for layer in plot.layers():
        ax, c = axes[layer.col], colours[layer.colour]
        ax.plot(*layer.steps, color=c, lw=1.8)
        for kind, pts in layer.markers.items():
            colour = {"edgecolors": c} if kind == EARLY_STOPPED else {"color": c}
            ax.scatter(*pts.xy, **colour, **_PNG_MARKERS[kind])
    for ax, panel_title in zip(axes, plot.titles, strict=True):
        ax.set(title=panel_title, xlabel=plot.axis_labels[0], ylabel=plot.axis_labels[1])
        ax.grid(True, alpha=0.3)
    line = {"ls": "", "color": "0.35"}
    handles = [
        Line2D([], [], color=colours[i], lw=1.8, marker="o", label=n)
        for i, n in enumerate(plot.optimizers)
    ]
    handles += [
        Line2D([], [], **line, marker="o", alpha=0.5, label="completed"),
        Line2D([], [], **line, marker="o", mfc="none", label="early-stopped"),
        Line2D([], [], **line, marker="x", label="failed"),
        Line2D([], [], **line, marker="*", ms=12, mec="k", label="knee"),
    ]
    fig.legend(handles=handles, loc="outside right center", frameon=False)
    fig.suptitle(title)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def plot_fronts_html(
    trials: pd.DataFrame, objectives: Objectives, path: str | Path, title: str
) -> None:
    """Self-contained interactive HTML (plotly.js embedded, works offline): one facet per
    epsilon, hover shows trial id, objectives and hyper-parameters, fronts as step lines."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    plot = _Plot(trials, objectives)
    palette = qualitative.Plotly
    fig = make_subplots(rows=1, cols=len(plot.panels), subplot_titles=plot.titles)
    for layer in plot.layers():
        c, where = palette[layer.colour % len(palette)], {"row": 1, "col": layer.col + 1}
        for kind, pts in layer.markers.items():
            if pts.rows.empty:
                continue
            if kind == "front":  # its points are among the completed ones: draw the steps
                x, y = layer.steps
                trace = go.Scatter(x=x, y=y, mode="lines", line={"color": c, "width": 2})
                trace.update(name=layer.name, showlegend=layer.legend, hoverinfo="skip")
            else:
                x, y = pts.xy
                marker = {"color": c, **_HTML_MARKERS[kind]}
                trace = go.Scatter(x=x, y=y, mode="markers", marker=marker, name=pts.label)
                trace.update(showlegend=False, hovertext=pts.hover, hoverinfo="text")
            fig.add_trace(trace.update(legendgroup=layer.name), **where)
    fig.update_xaxes(title_text=plot.axis_labels[0])
    fig.update_yaxes(title_text=plot.axis_labels[1])
    fig.update_layout(
        title=title + "<br><sup>filled: completed, hollow: early-stopped, x: failed, "
        "star: knee; lines: Pareto fronts of completed trials</sup>",
        hovermode="closest",
        template="plotly_white",
        width=max(700, 480 * len(plot.panels)),
        height=520,
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)


# --------------------------------------------------------------------------- table


def format_front_table(
    front: pd.DataFrame, objectives: Objectives, extra_columns: Sequence[str] = ()
) -> Table:
    """A rich table of front rows: group/trial columns, objectives (with arrows), extras."""
    metrics, modes = check_objectives(objectives)
    lead = [c for c in ("optimizer", "epsilon", "trial_id") if c in front.columns]
    extras = [c for c in extra_columns if c in front.columns and c not in (*lead, *metrics)]
    table = Table(title="Pareto front", show_lines=False)
    for c in lead:
        table.add_column(str(c))
    for m, mode in zip(metrics, modes, strict=True):
        table.add_column(f"{m} {'↑' if mode == 'max' else '↓'}", justify="right")
    for c in extras:
        table.add_column(str(c), justify="right")
    for _, row in front.iterrows():
        table.add_row(*(_fmt(row[c]) for c in (*lead, *metrics, *extras)))
    return table


def print_front_table(
    front: pd.DataFrame, objectives: Objectives, extra_columns: Sequence[str] = ()
) -> None:
    """Print the front on stdout; off a terminal (logs, CI) at a width that fits it."""
    console = Console() if sys.stdout.isatty() else Console(width=200)
    console.print(format_front_table(front, objectives, extra_columns))
