"""Pareto fronts of sweep trials: validation accuracy (max) versus validation ECE (min).

Trials are rows of a DataFrame (columns ``optimizer``, ``epsilon``, ``trial_id``, ``status``,
the objective columns, optional test metrics and hyper-parameters). Objectives are two
``(metric, mode)`` pairs with mode ``"max"`` or ``"min"``, e.g.
``[("val_accuracy", "max"), ("val_ece", "min")]``.

Only ``status == "completed"`` trials are eligible for a front: an early-stopped trial was
judged on a shorter run and a failed one has no trustworthy metrics, so neither is ever a
front point, whatever its values. Internally every objective is turned into a minimisation
(``max`` columns are negated).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from dpivon.errors import DpivonError

COMPLETED = "completed"
EARLY_STOPPED = "early_stopped"
FAILED = "failed"
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

# Rows compared at once in non_dominated_mask: bounds the (block, n, k) boolean temporaries.
_BLOCK = 1024


# --------------------------------------------------------------------------- core


def _signs(modes: Sequence[str]) -> np.ndarray:
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise DpivonError(f"unknown objective mode(s) {bad}; choose one of: {', '.join(MODES)}")
    return np.array([-1.0 if m == "max" else 1.0 for m in modes])


def _check_objectives(objectives: Objectives) -> tuple[list[str], list[str]]:
    objectives = list(objectives)
    if len(objectives) != 2 or any(len(o) != 2 for o in objectives):
        raise DpivonError(
            f"objectives must be two (metric, mode) pairs, e.g. "
            f"[('val_accuracy', 'max'), ('val_ece', 'min')]; got {objectives!r}"
        )
    metrics = [str(m) for m, _ in objectives]
    modes = [str(mode) for _, mode in objectives]
    _signs(modes)
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
    v = values * _signs(modes)  # minimise everything
    valid = ~np.isnan(v).any(axis=1)
    mask = np.zeros(len(v), dtype=bool)
    pts = v[valid]
    if len(pts) == 0:
        return mask
    dominated = np.zeros(len(pts), dtype=bool)
    for start in range(0, len(pts), _BLOCK):
        block = pts[start : start + _BLOCK]  # candidates (b, k) judged against all (n, k)
        no_worse = (pts[None, :, :] <= block[:, None, :]).all(axis=2)  # [i, j]: j <= i
        better = (pts[None, :, :] < block[:, None, :]).any(axis=2)  # [i, j]: j < i somewhere
        dominated[start : start + len(block)] = (no_worse & better).any(axis=1)
    mask[np.flatnonzero(valid)] = ~dominated
    return mask


def _sort_best_first(df: pd.DataFrame, metrics: list[str], modes: list[str], by=()) -> pd.DataFrame:
    keys = [*by, *metrics]
    ascending = [True] * len(by) + [m == "min" for m in modes]
    return df.sort_values(keys, ascending=ascending, kind="mergesort", na_position="last")


def _groups(df: pd.DataFrame, by: Sequence[str]):
    if not by:
        yield (), df
        return
    yield from df.groupby(list(by), sort=True, dropna=False)


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
    parts = []
    for _, group in _groups(eligible, by):
        mask = non_dominated_mask(group[metrics].to_numpy(dtype=np.float64), modes)
        parts.append(group[mask])
    front = pd.concat(parts) if parts else trials.iloc[:0]
    front = front.assign(on_front=True)
    return _sort_best_first(front, metrics, modes, by)


def hypervolume_2d(
    points: np.ndarray,
    modes: Sequence[str],
    reference: tuple[float, float] = (
        DEFAULT_REFERENCE["val_accuracy"],
        DEFAULT_REFERENCE["val_ece"],
    ),
) -> float:
    """Exact area dominated by ``points`` (n x 2) and bounded by ``reference``.

    Computed in minimisation form (``max`` objectives negated): the union of the boxes
    ``[p, reference]``. Points not strictly better than the reference in both objectives
    and NaN rows add nothing. The default reference (0, 1) is for (accuracy, ECE) only;
    for other metrics pass ``default_reference(objectives)`` or an explicit point.
    """
    pts = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    signs = _signs(modes)
    if len(signs) != 2:
        raise DpivonError(f"hypervolume_2d needs two modes; got {list(modes)}")
    ref = np.asarray(reference, dtype=np.float64) * signs
    pts = pts * signs
    pts = pts[~np.isnan(pts).any(axis=1)]
    pts = pts[(pts < ref).all(axis=1)]
    if len(pts) == 0:
        return 0.0
    pts = pts[non_dominated_mask(pts, ("min", "min"))]
    order = np.lexsort((pts[:, 1], pts[:, 0]))  # x ascending, so y descending on the front
    pts = pts[order]
    area, prev_y = 0.0, ref[1]
    for x, y in pts:
        if y < prev_y:
            area += (ref[0] - x) * (prev_y - y)
            prev_y = y
    return float(area)


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
    v = front[metrics].to_numpy(dtype=np.float64) * _signs(modes)
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
        order = [metrics[k], metrics[1 - k]]
        order_modes = [modes[k], modes[1 - k]]
        ranked = _sort_best_first(group, order, order_modes)
        labels.append(ranked.index[0])
    return front.loc[labels]


# --------------------------------------------------------------------------- display


def _direction(metric: str, mode: str) -> str:
    return f"{metric} ({'higher' if mode == 'max' else 'lower'} is better)"


def _staircase(front_values: np.ndarray, modes: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """x, y of the attainment step line through a 2-D front (original units)."""
    signs = _signs(modes)
    v = np.asarray(front_values, dtype=np.float64).reshape(-1, 2) * signs
    v = v[np.lexsort((v[:, 1], v[:, 0]))]
    xs, ys = [], []
    for i, (x, y) in enumerate(v):
        if i:
            xs.append(x)
            ys.append(v[i - 1, 1])
        xs.append(x)
        ys.append(y)
    return np.array(xs) * signs[0], np.array(ys) * signs[1]


def _epsilon_panels(trials: pd.DataFrame) -> list[tuple[Any, pd.DataFrame]]:
    if "epsilon" not in trials.columns:
        return [(None, trials)]
    panels = list(trials.groupby("epsilon", sort=True, dropna=False))
    return panels or [(None, trials)]


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


def _optimizers(trials: pd.DataFrame) -> list[str]:
    if "optimizer" not in trials.columns:
        return ["trials"]
    return sorted(trials["optimizer"].astype(str).unique())


def _by_optimizer(df: pd.DataFrame, name: str) -> pd.DataFrame:
    if "optimizer" not in df.columns:
        return df
    return df[df["optimizer"].astype(str) == name]


def _prepare(trials: pd.DataFrame, objectives: Objectives) -> tuple[list[str], list[str]]:
    metrics, modes = _check_objectives(objectives)
    _check_columns(trials, ["status", *metrics])
    return metrics, modes


def plot_fronts_png(
    trials: pd.DataFrame, objectives: Objectives, path: str | Path, title: str
) -> None:
    """Static PNG: one panel per epsilon, all trials faint (filled completed, hollow
    early-stopped, x failed), each optimizer's front as a step line, its knee as a star."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    metrics, modes = _prepare(trials, objectives)
    panels = _epsilon_panels(trials)
    optimizers = _optimizers(trials)
    palette = [f"C{i}" for i in range(10)]
    colours = {name: palette[i % len(palette)] for i, name in enumerate(optimizers)}

    fig = Figure(figsize=(5.2 * len(panels) + 2.2, 4.8), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (eps, panel) in zip(axes, panels, strict=True):
        for name in optimizers:
            rows = _by_optimizer(panel, name)
            c = colours[name]
            x, y = rows[metrics[0]], rows[metrics[1]]
            done = (rows["status"] == COMPLETED).to_numpy()
            stopped = (rows["status"] == EARLY_STOPPED).to_numpy()
            failed = ~(done | stopped)
            ax.scatter(x[done], y[done], s=22, color=c, alpha=0.35, linewidths=0)
            ax.scatter(x[stopped], y[stopped], s=22, facecolors="none", edgecolors=c, alpha=0.5)
            ax.scatter(x[failed], y[failed], s=18, marker="x", color=c, alpha=0.35)
            front = pareto_front(rows, objectives)
            if front.empty:
                continue
            sx, sy = _staircase(front[metrics].to_numpy(), modes)
            ax.plot(sx, sy, color=c, lw=1.8, drawstyle="default")
            ax.scatter(
                front[metrics[0]],
                front[metrics[1]],
                s=30,
                color=c,
                edgecolors="k",
                linewidths=0.5,
                zorder=3,
            )
            knee = front.loc[knee_point(front, objectives)]
            ax.scatter(
                [knee[metrics[0]]],
                [knee[metrics[1]]],
                s=220,
                marker="*",
                color=c,
                edgecolors="k",
                linewidths=0.8,
                zorder=4,
            )
        ax.set_title(_epsilon_title(eps))
        ax.set_xlabel(_direction(metrics[0], modes[0]))
        ax.set_ylabel(_direction(metrics[1], modes[1]))
        ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], color=colours[n], lw=1.8, marker="o", label=n) for n in optimizers]
    grey = "0.35"
    handles += [
        Line2D([], [], ls="", marker="o", color=grey, alpha=0.5, label="completed"),
        Line2D([], [], ls="", marker="o", mfc="none", color=grey, label="early-stopped"),
        Line2D([], [], ls="", marker="x", color=grey, label="failed"),
        Line2D([], [], ls="", marker="*", ms=12, color=grey, mec="k", label="knee"),
    ]
    fig.legend(handles=handles, loc="outside right center", frameon=False)
    fig.suptitle(title)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _metric_like(column: str, metrics: Sequence[str]) -> bool:
    return column in metrics or column.startswith(("val_", "test_", "train_"))


def _fmt(value: Any) -> str:
    if isinstance(value, float | np.floating):
        return "nan" if np.isnan(value) else f"{value:.4g}"
    return str(value)


def _hover(rows: pd.DataFrame, metrics: Sequence[str]) -> list[str]:
    lead = [c for c in ("trial_id", "optimizer", "epsilon", "status") if c in rows.columns]
    params = [c for c in rows.columns if c not in lead and not _metric_like(str(c), metrics)]
    columns = [*lead, *metrics, *params]
    return [
        "<br>".join(f"{c}: {_fmt(row[c])}" for c in columns) for _, row in rows[columns].iterrows()
    ]


def plot_fronts_html(
    trials: pd.DataFrame, objectives: Objectives, path: str | Path, title: str
) -> None:
    """Self-contained interactive HTML (plotly.js embedded, works offline): one facet per
    epsilon, hover shows trial id, objectives and hyper-parameters, fronts as step lines."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    metrics, modes = _prepare(trials, objectives)
    trials = trials.drop(columns=["on_front"], errors="ignore")
    panels = _epsilon_panels(trials)
    optimizers = _optimizers(trials)
    palette = qualitative.Plotly
    colours = {name: palette[i % len(palette)] for i, name in enumerate(optimizers)}
    fig = make_subplots(
        rows=1, cols=len(panels), subplot_titles=[_epsilon_title(e) for e, _ in panels]
    )
    symbols = {COMPLETED: "circle", EARLY_STOPPED: "circle-open"}
    seen: set[str] = set()
    for col, (_, panel) in enumerate(panels, start=1):
        for name in optimizers:
            rows = _by_optimizer(panel, name)
            c = colours[name]
            first = name not in seen
            seen.add(name)
            for status in (COMPLETED, EARLY_STOPPED, FAILED):
                sel = rows[rows["status"] == status]
                if sel.empty:
                    continue
                fig.add_trace(
                    go.Scatter(
                        x=sel[metrics[0]],
                        y=sel[metrics[1]],
                        mode="markers",
                        name=f"{name} ({status})",
                        legendgroup=name,
                        showlegend=False,
                        marker={
                            "color": c,
                            "opacity": 0.45,
                            "size": 7,
                            "symbol": symbols.get(status, "x"),
                        },
                        hovertext=_hover(sel, metrics),
                        hoverinfo="text",
                    ),
                    row=1,
                    col=col,
                )
            front = pareto_front(rows, objectives)
            if front.empty:
                continue
            sx, sy = _staircase(front[metrics].to_numpy(), modes)
            fig.add_trace(
                go.Scatter(
                    x=sx,
                    y=sy,
                    mode="lines",
                    name=name,
                    legendgroup=name,
                    showlegend=first,
                    line={"color": c, "width": 2},
                    hoverinfo="skip",
                ),
                row=1,
                col=col,
            )
            knee = front.loc[[knee_point(front, objectives)]]
            fig.add_trace(
                go.Scatter(
                    x=knee[metrics[0]],
                    y=knee[metrics[1]],
                    mode="markers",
                    name=f"{name} knee",
                    legendgroup=name,
                    showlegend=False,
                    marker={
                        "color": c,
                        "size": 16,
                        "symbol": "star",
                        "line": {"color": "black", "width": 1},
                    },
                    hovertext=[f"knee<br>{h}" for h in _hover(knee, metrics)],
                    hoverinfo="text",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text=_direction(metrics[0], modes[0]), row=1, col=col)
        fig.update_yaxes(title_text=_direction(metrics[1], modes[1]), row=1, col=col)
    fig.update_layout(
        title=title + "<br><sup>filled: completed, hollow: early-stopped, x: failed, "
        "star: knee; lines: Pareto fronts of completed trials</sup>",
        hovermode="closest",
        template="plotly_white",
        width=max(700, 480 * len(panels)),
        height=520,
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)


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
