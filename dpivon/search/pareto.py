"""Pareto fronts of sweep trials: validation accuracy (max) versus validation ECE (min).

Trials are rows of a DataFrame (columns ``optimizer``, ``epsilon``, ``trial_id``, ``status``,
the objective columns, optional test metrics and hyper-parameters). Objectives are two
``(metric, mode)`` pairs with mode ``"max"`` or ``"min"``, e.g.
``[("val_accuracy", "max"), ("val_ece", "min")]``.

Only ``status == "completed"`` trials are eligible for a front: an early-stopped trial was
judged on a shorter run and a failed one has no trustworthy metrics, so neither is ever a
front point, whatever its values. Non-dominated filtering and the hypervolume come from
``moocore``; both plots draw the layers of one ``_Plot``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import moocore
import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from dpivon.errors import DpivonError
from dpivon.search.results import TrialStatus

COMPLETED, EARLY_STOPPED, FAILED = (
    TrialStatus.COMPLETED,
    TrialStatus.EARLY_STOPPED,
    TrialStatus.FAILED,
)
MODES = ("max", "min")
PICKS = ("knee", "max-accuracy", "min-ece", "pareto")

# Hypervolume reference point per metric: a value every useful trial beats. Accuracy 0 and
# ECE 1 are the worst possible values; the Brier score (sum over classes) is at most 2; NLL
# is unbounded, so its reference is the NLL of the uniform prediction over CIFAR-10's 10
# classes (log 10): a trial worse than chance contributes no volume.
DEFAULT_REFERENCE: dict[str, float] = {
    "val_accuracy": 0.0,
    "val_ece": 1.0,
    "val_nll": math.log(10.0),
    "val_brier": 2.0,
}

Objectives = Sequence[tuple[str, str]]
_ACCURACY_ECE_REFERENCE = (DEFAULT_REFERENCE["val_accuracy"], DEFAULT_REFERENCE["val_ece"])
_METRIC_PREFIX = ("val_", "test_", "train_")  # metric columns: not shown as hyper-parameters


# --------------------------------------------------------------------------- core


def _maximise(modes: Sequence[str]) -> list[bool]:
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise DpivonError(f"unknown objective mode(s) {bad}; choose one of: {', '.join(MODES)}")
    return [m == "max" for m in modes]


def _check_objectives(objectives: Objectives) -> tuple[list[str], list[str]]:
    objectives = list(objectives)
    if len(objectives) != 2 or any(len(o) != 2 for o in objectives):
        raise DpivonError(
            f"objectives must be two (metric, mode) pairs, e.g. "
            f"[('val_accuracy', 'max'), ('val_ece', 'min')]; got {objectives!r}"
        )
    metrics = [str(m) for m, _ in objectives]
    modes = [str(mode) for _, mode in objectives]
    _maximise(modes)
    return metrics, modes


def _check_columns(trials: pd.DataFrame, columns: Sequence[str]) -> None:
    missing = [c for c in columns if c not in trials.columns]
    if missing:
        raise DpivonError(
            f"trial table has no column(s) {missing}; available: {', '.join(map(str, trials))}"
        )


def non_dominated_mask(values: np.ndarray, modes: Sequence[str]) -> np.ndarray:
    """Boolean mask of the rows of ``values`` (n points x k objectives) on the Pareto front.

    A point is dominated if another point is at least as good in every objective and
    strictly better in at least one. Exact duplicates do not dominate each other, so both
    are kept. Rows with a NaN are never on the front (and dominate nothing).
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2:
        raise DpivonError(f"values must be a 2-D array (points x objectives); got {values.shape}")
    if values.shape[1] != len(modes):
        raise DpivonError(f"{values.shape[1]} objective columns but {len(modes)} modes")
    maximise = _maximise(modes)
    valid = ~np.isnan(values).any(axis=1)
    mask = np.zeros(len(values), dtype=bool)
    if valid.any():
        mask[valid] = moocore.is_nondominated(values[valid], maximise=maximise, keep_weakly=True)
    return mask


def _sort_best_first(df: pd.DataFrame, metrics: list[str], modes: list[str], by=()) -> pd.DataFrame:
    keys = [*by, *metrics]
    ascending = [True] * len(by) + [m == "min" for m in modes]
    return df.sort_values(keys, ascending=ascending, kind="mergesort", na_position="last")


def _groups(df: pd.DataFrame, by: Sequence[str]):
    return df.groupby(list(by), sort=True, dropna=False) if by else [((), df)]


def pareto_front(
    trials: pd.DataFrame, objectives: Objectives, *, by: Sequence[str] = ()
) -> pd.DataFrame:
    """Rows of ``trials`` on the Pareto front of ``objectives``, with a column ``on_front``.

    Only rows with ``status == "completed"`` are eligible. With ``by`` (e.g.
    ``("optimizer", "epsilon")``) one front is computed per group. The result is sorted by
    the ``by`` columns, then by the first objective (best first, ties broken by the second
    objective); without ``by`` simply by the first objective. The original index is kept.
    """
    metrics, modes = _check_objectives(objectives)
    by = list(by)
    _check_columns(trials, ["status", *metrics, *by])
    eligible = trials[trials["status"] == COMPLETED]
    parts = [
        group[non_dominated_mask(group[metrics].to_numpy(dtype=np.float64), modes)]
        for _, group in _groups(eligible, by)
    ]
    front = pd.concat(parts) if parts else trials.iloc[:0]
    return _sort_best_first(front.assign(on_front=True), metrics, modes, by)


def hypervolume_2d(
    points: np.ndarray,
    modes: Sequence[str],
    reference: tuple[float, float] = _ACCURACY_ECE_REFERENCE,
) -> float:
    """Exact area dominated by ``points`` (n x 2) and bounded by ``reference``.

    The union of the boxes between each point and ``reference``. Points not strictly better
    than the reference in both objectives and NaN rows add nothing. The default reference
    (0, 1) is for (accuracy, ECE) only; for other metrics pass
    ``default_reference(objectives)`` or an explicit point.
    """
    maximise = _maximise(modes)
    if len(maximise) != 2:
        raise DpivonError(f"hypervolume_2d needs two modes; got {list(modes)}")
    pts = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    pts = pts[~np.isnan(pts).any(axis=1)]
    ref = np.asarray(reference, dtype=np.float64)
    return float(moocore.hypervolume(pts, ref=ref, maximise=maximise))


def default_reference(objectives: Objectives) -> tuple[float, float]:
    """Hypervolume reference point for ``objectives`` from ``DEFAULT_REFERENCE``."""
    metrics, _ = _check_objectives(objectives)
    missing = [m for m in metrics if m not in DEFAULT_REFERENCE]
    if missing:
        raise DpivonError(
            f"no default hypervolume reference for {missing}; pass one explicitly "
            f"(known: {', '.join(DEFAULT_REFERENCE)})"
        )
    return (DEFAULT_REFERENCE[metrics[0]], DEFAULT_REFERENCE[metrics[1]])


def knee_point(front: pd.DataFrame, objectives: Objectives) -> Hashable:
    """Index label of the knee of one front (one group: call it per optimizer/epsilon).

    Rule: normalise each objective to [0, 1] over the front (min-max, in minimisation form),
    join the two extreme points (best in the first objective, best in the second) by a
    straight line and return the point farthest from that line on the side of the ideal
    point (the one that bulges most toward "best in both"). If no point lies on that side
    (a straight or concave front), or the front has 1 or 2 points, return the point best in
    the first objective. Ties go to the point better in the first objective. Rows with NaN
    objectives are ignored.
    """
    metrics, modes = _check_objectives(objectives)
    _check_columns(front, metrics)
    front = front[front[metrics].notna().all(axis=1)]
    if front.empty:
        raise DpivonError("no completed trial on the Pareto front; cannot pick a knee point")
    front = _sort_best_first(front, metrics, modes)
    if len(front) <= 2:
        return front.index[0]
    signs = np.where(_maximise(modes), -1.0, 1.0)
    v = front[metrics].to_numpy(dtype=np.float64) * signs  # minimise everything
    span = v.max(axis=0) - v.min(axis=0)
    span[span == 0] = 1.0
    z = (v - v.min(axis=0)) / span
    a = z[np.argmin(z[:, 0])]  # best first objective
    b = z[np.lexsort((z[:, 0], z[:, 1]))[0]]  # best second objective
    ab = b - a
    norm = float(np.hypot(*ab))
    if norm == 0.0:
        return front.index[0]
    # Signed distance to the line a-b, positive toward the ideal point (0, 0).
    cross = ab[0] * (z[:, 1] - a[1]) - ab[1] * (z[:, 0] - a[0])
    ideal_side = np.sign(ab[0] * (0 - a[1]) - ab[1] * (0 - a[0])) or 1.0
    dist = ideal_side * cross / norm
    best = int(np.argmax(dist))
    if dist[best] <= 1e-12:
        return front.index[0]
    return front.index[best]


def pick(
    front: pd.DataFrame, objectives: Objectives, how: str, *, by: Sequence[str] = ()
) -> pd.DataFrame:
    """Rows chosen from a front: ``how`` in ``PICKS``.

    ``"knee"`` the knee point (see ``knee_point``), ``"max-accuracy"`` the row best in the
    first objective, ``"min-ece"`` the row best in the second objective, ``"pareto"`` all
    rows. With ``by`` one choice is made per group (use the ``by`` of ``pareto_front``).
    """
    metrics, modes = _check_objectives(objectives)
    if how not in PICKS:
        raise DpivonError(f"unknown pick {how!r}; choose one of: {', '.join(PICKS)}")
    if front.empty:
        raise DpivonError(
            "no completed trial on the Pareto front; every trial failed, was early-stopped "
            "or has no value for " + " / ".join(metrics) + "; check the sweep's trials"
        )
    _check_columns(front, [*metrics, *by])
    if how == "pareto":
        return front
    labels = []
    for _, group in _groups(front, list(by)):
        if how == "knee":
            labels.append(knee_point(group, objectives))
            continue
        k = 0 if how == "max-accuracy" else 1
        ranked = _sort_best_first(group, [metrics[k], metrics[1 - k]], [modes[k], modes[1 - k]])
        labels.append(ranked.index[0])
    return front.loc[labels]


# --------------------------------------------------------------------------- plot layers


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
        self.metrics, self.modes = _check_objectives(objectives)
        _check_columns(trials, ["status", *self.metrics])
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
    metrics, modes = _check_objectives(objectives)
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
