"""Pareto fronts of sweep trials: validation accuracy (max) versus validation ECE (min).

Trials are rows of a DataFrame (columns ``optimizer``, ``epsilon``, ``trial_id``, ``status``,
the objective columns, optional test metrics and hyper-parameters). Objectives are two
``(metric, mode)`` pairs with mode ``"max"`` or ``"min"``, e.g.
``[("val_accuracy", "max"), ("val_ece", "min")]``.

Only ``status == "completed"`` trials are eligible for a front: an early-stopped trial was
judged on a shorter run and a failed one has no trustworthy metrics, so neither is ever a
front point, whatever its values. Non-dominated filtering and the hypervolume come from
``moocore``. The plots and the table of fronts are in :mod:`dpivon.search.pareto_views`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import moocore
import numpy as np
import pandas as pd

from dpivon.errors import DpivonError
from dpivon.tracking.layout import RunOutcome

COMPLETED, EARLY_STOPPED, FAILED = (
    RunOutcome.COMPLETED,
    RunOutcome.EARLY_STOPPED,
    RunOutcome.FAILED,
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
# the same metrics on corrupted validation images (`dpivon.evaluation.shift`) have the same bounds
DEFAULT_REFERENCE.update(
    {f"val_shift_{m}": DEFAULT_REFERENCE[f"val_{m}"] for m in ("accuracy", "ece", "nll")}
)

Objectives = Sequence[tuple[str, str]]
_ACCURACY_ECE_REFERENCE = (DEFAULT_REFERENCE["val_accuracy"], DEFAULT_REFERENCE["val_ece"])


def _maximise(modes: Sequence[str]) -> list[bool]:
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise DpivonError(f"unknown objective mode(s) {bad}; choose one of: {', '.join(MODES)}")
    return [m == "max" for m in modes]


def check_objectives(objectives: Objectives) -> tuple[list[str], list[str]]:
    """The metrics and modes of two ``(metric, mode)`` pairs; one line when they are not."""
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


def check_columns(trials: pd.DataFrame, columns: Sequence[str]) -> None:
    """One line naming the ``columns`` the trial table lacks, if any."""
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
    metrics, modes = check_objectives(objectives)
    by = list(by)
    check_columns(trials, ["status", *metrics, *by])
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
    metrics, _ = check_objectives(objectives)
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
    metrics, modes = check_objectives(objectives)
    check_columns(front, metrics)
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
    metrics, modes = check_objectives(objectives)
    if how not in PICKS:
        raise DpivonError(f"unknown pick {how!r}; choose one of: {', '.join(PICKS)}")
    if front.empty:
        raise DpivonError(
            "no completed trial on the Pareto front; every trial failed, was early-stopped "
            "or has no value for " + " / ".join(metrics) + "; check the sweep's trials"
        )
    check_columns(front, [*metrics, *by])
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
