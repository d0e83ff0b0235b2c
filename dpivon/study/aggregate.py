"""From a benchmark's MLflow child runs to per-(method, epsilon) means, spreads and a verdict.

A `RunRecord` is what the report needs of one finished run: its final metrics, its
per-epoch diagnostics (read from the MLflow metric history, so whatever `train` logged;
non-IVON methods simply have none) and its test reliability bins. Aggregation is over the
seeds of each (method, epsilon): mean, sample standard deviation (ddof 1) and the 95 % t
interval of the mean; comparisons test per-seed differences (`dpivon.study.significance`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dpivon.evaluation.calibration import is_determined
from dpivon.evaluation.metrics import ReliabilityDiagram
from dpivon.runs.tracked import end_to_end_epsilon
from dpivon.study.layout import KEY_TAG, RELIABILITY_FILE, is_completed
from dpivon.study.significance import (
    UNKNOWN,
    Difference,
    mean_interval,
    seed_difference,
    verdict_word,
)
from dpivon.tracking.client import Tracker
from dpivon.tracking.layout import EPSILON_TAG, OPTIMIZER_TAG

# What the results table aggregates, with the direction in which each improves.
AGGREGATED: dict[str, str] = {
    "test_accuracy": "max",
    "test_nll": "min",
    "test_ece": "min",
    "test_brier": "min",
    "test_ts_nll": "min",
    "test_ts_ece": "min",
    "temperature": "none",
    "epsilon_spent": "none",
    # the training composed with the tuning that chose the run's settings on the same
    # images (dpivon.runs.tracked.end_to_end_epsilon): what the released model costs
    "epsilon_end_to_end": "none",
    "wall_time_s": "none",
    # under shift (a pipeline's ``shift``), at severity 3, as Ovadia et al. compare methods:
    # NaN for runs scored without it
    "test_shift_s3_accuracy": "max",
    "test_shift_s3_ece": "min",
    "test_shift_s3_aurc_maxprob": "min",
    # a point-estimate model averaged over weight noise (a benchmark's weight_noise_scales):
    # the scale its validation split chose and the test scores of that average
    "weight_noise_scale": "none",
    "test_wna_accuracy": "max",
    "test_wna_nll": "min",
    "test_wna_ece": "min",
    "test_wna_shift_s3_ece": "min",
}
# Per-epoch keys the collapse diagnostics read (dpivon.optim.dp_ivon.DPIVON documents them).
DIAGNOSTIC_KEYS = (
    "projected_fraction",
    "hess_median",
    "hess_q10",
    "hess_q90",
    "posterior_std_median",
    "posterior_std_q10",
    "posterior_std_q90",
    "clamped_noise_share_median",
    "grad_snr_median",
    "curvature_update_share",
    "curvature_horizon_share",
    "curvature_learned_share_median",
    "curvature_learned_share_q10",
    "curvature_learned_share_q90",
)
# The diagnostics summarised at the last epoch beside the metrics (column ``last_<key>``;
# NaN for a method that logs none), with the direction in which each improves: the
# fraction of v_hat projected to zero and the clamped-noise share of h measure the collapse;
# the curvature's shares say whether h learned at all (a frozen h: a horizon share near 0).
LAST_EPOCH_DIAGNOSTICS: dict[str, str] = {
    "projected_fraction": "min",
    "clamped_noise_share_median": "min",
    "hess_median": "none",
    "posterior_std_median": "none",
    "curvature_horizon_share": "none",
    "curvature_learned_share_median": "none",
    "curvature_update_share": "none",
}
# Every per-run column the aggregation summarises, with its direction.
SUMMARISED: dict[str, str] = {
    **AGGREGATED,
    **{f"last_{key}": direction for key, direction in LAST_EPOCH_DIAGNOSTICS.items()},
}


@dataclass
class RunRecord:
    """One finished benchmark run."""

    method: str
    optimizer: str
    epsilon: float
    replicate: int
    metrics: dict[str, float]
    train_images: int | None = None  # what the run trained on (None: not recorded)
    history: dict[str, list[float]] = field(default_factory=dict)  # key -> value per epoch
    reliability: ReliabilityDiagram | None = None
    run_id: str = ""


def reliability_from_dict(data: dict) -> ReliabilityDiagram:
    def floats(values):
        return np.array([math.nan if v is None else v for v in values], dtype=np.float64)

    return ReliabilityDiagram(
        bin_edges=np.asarray(data["bin_edges"], dtype=np.float64),
        bin_accuracy=floats(data["bin_accuracy"]),
        bin_confidence=floats(data["bin_confidence"]),
        bin_count=np.asarray(data["bin_count"], dtype=np.int64),
    )


def load_records(tracker: Tracker, parent_run_id: str) -> list[RunRecord]:
    """The completed children of a benchmark's parent run, as records."""
    records = []
    for run in tracker.child_runs_by_tag(parent_run_id, KEY_TAG).values():
        if not is_completed(run):
            continue
        tags, run_id = run.data.tags, run.info.run_id
        epsilon = float(tags[EPSILON_TAG])
        metrics = dict(run.data.metrics)
        if "temperature" in metrics and not is_determined(metrics["temperature"]):
            # fitted before `fit_temperature` refused such fits: no scaling was determined
            metrics = {k: v for k, v in metrics.items() if k != "temperature"
                       and not k.startswith("test_ts_")}  # fmt: skip
        if math.isinf(epsilon):
            metrics["epsilon_spent"] = math.inf  # MLflow stores finite values only
        metrics["epsilon_end_to_end"] = end_to_end_epsilon(metrics)
        history = {}
        for name in DIAGNOSTIC_KEYS:
            if name in metrics:
                history[name] = [m.value for m in tracker.metric_history(run_id, name)]
        if "hess_median" in history and "curvature_horizon_share" not in history:
            steps = [m.value for m in tracker.metric_history(run_id, "steps")]
            history.update(curvature_shares_of_earlier_run(history, run.data.params, steps))
        train_images = run.data.params.get("train_images")
        bins = tracker.load_dict(run_id, RELIABILITY_FILE)
        reliability = None if bins is None else reliability_from_dict(bins)
        records.append(
            RunRecord(
                method=tags["dpivon.method"],
                optimizer=tags[OPTIMIZER_TAG],
                epsilon=epsilon,
                replicate=int(tags["dpivon.replicate"]),
                metrics=metrics,
                train_images=None if train_images is None else int(train_images),
                history=history,
                reliability=reliability,
                run_id=run_id,
            )
        )
    return records


def curvature_shares_of_earlier_run(
    history: dict[str, list[float]], params: dict[str, str], steps: list[float]
) -> dict[str, list[float]]:
    """The curvature's shares per epoch of an IVON-family run logged before they were, from
    its h quantiles: after t steps the horizon share is 1 - beta2^t and, with one hess_init
    and beta2 for all parameters, a quantile of the learned share 1 - hess_init beta2^t / h
    is that map of h's quantile (it increases with h). ``steps`` per epoch as logged (a
    private run), else epochs of ceil(train_images / batch_size)."""
    beta2, hess_init = float(params["beta2"]), float(params["hess_init"])
    epochs = len(history["hess_median"])
    if len(steps) != epochs:
        per_epoch = math.ceil(int(params["train_images"]) / int(params["batch_size"]))
        steps = [per_epoch * (epoch + 1) for epoch in range(epochs)]
    decayed = [hess_init * beta2**t for t in steps]
    shares = {"curvature_horizon_share": [1.0 - beta2**t for t in steps]}
    for quantile in ("median", "q10", "q90"):
        values = history.get(f"hess_{quantile}")
        if values is not None:
            shares[f"curvature_learned_share_{quantile}"] = [
                1.0 - d / h for d, h in zip(decayed, values, strict=True)
            ]
    return shares


def _last_value(values: Sequence[float] | None) -> float:
    """The last epoch's value of a logged series (NaN when the run logged none)."""
    return float(values[-1]) if values else math.nan


def records_frame(records: Sequence[RunRecord]) -> pd.DataFrame:
    """One row per run: method, optimizer, epsilon, replicate, training images, the
    aggregated metrics and the last epoch's diagnostics."""
    rows = [
        {
            "method": r.method,
            "optimizer": r.optimizer,
            "epsilon": r.epsilon,
            "replicate": r.replicate,
            "train_images": r.train_images,
            **{k: r.metrics.get(k, math.nan) for k in AGGREGATED},
            **{f"last_{k}": _last_value(r.history.get(k)) for k in LAST_EPOCH_DIAGNOSTICS},
        }
        for r in records
    ]
    columns = ["method", "optimizer", "epsilon", "replicate", "train_images", *SUMMARISED]
    return pd.DataFrame(rows, columns=columns)


def seed_summary(metric: str, values: np.ndarray) -> dict[str, float]:
    """``<metric>_mean``, ``_std`` (sample std over seeds) and ``_ci_low`` / ``_ci_high``
    (the mean's 95 % t interval) of one metric's values over seeds; all but the mean NaN
    with one seed or a missing value."""
    spread = len(values) > 1 and bool(np.isfinite(values).all())
    interval = mean_interval(values) if spread else UNKNOWN
    return {
        f"{metric}_mean": float(np.mean(values)),
        f"{metric}_std": float(np.std(values, ddof=1)) if spread else math.nan,
        f"{metric}_ci_low": interval.low,
        f"{metric}_ci_high": interval.high,
    }


def aggregate(
    records: Sequence[RunRecord], method_order: Sequence[str] | None = None
) -> pd.DataFrame:
    """Per (method, epsilon): ``n`` seeds, the training images (the seeds share the split)
    and ``<column>_mean``, ``<column>_std``, ``<column>_ci_low`` / ``_ci_high`` for each
    column of SUMMARISED.

    See :func:`seed_summary`. Rows follow
    ``method_order`` (else first appearance), then epsilon ascending (inf last).
    """
    frame = records_frame(records)
    order = list(method_order or dict.fromkeys(frame["method"]))
    rows = []
    for (method, epsilon), group in frame.groupby(["method", "epsilon"], sort=False):
        row: dict[str, object] = {
            "method": method,
            "optimizer": group["optimizer"].iloc[0],
            "epsilon": float(epsilon),
            "n": len(group),
            "train_images": group["train_images"].iloc[0],
        }
        for metric in SUMMARISED:
            row |= seed_summary(metric, group[metric].to_numpy(dtype=np.float64))
        rows.append(row)
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    rank = {m: i for i, m in enumerate(order)}
    table["_rank"] = table["method"].map(lambda m: rank.get(m, len(rank)))
    table = table.sort_values(["_rank", "epsilon"], kind="mergesort").drop(columns="_rank")
    return table.reset_index(drop=True)


@dataclass(frozen=True)
class Comparison:
    """The best and runner-up methods at one epsilon on one metric, and the difference
    between them over the seeds (best minus runner-up)."""

    metric: str
    epsilon: float
    better: str  # "max" or "min": the direction in which the metric improves
    best: str
    best_mean: float
    second: str | None
    second_mean: float
    difference: Difference | None  # None without a runner-up

    @property
    def gap(self) -> float:
        return abs(self.best_mean - self.second_mean)

    @property
    def word(self) -> str:
        """``leads`` (the difference's interval excludes 0), ``indistinguishable`` or
        ``unknown`` (one seed), from :func:`dpivon.study.significance.verdict_word`."""
        if self.difference is None:
            return "unknown"
        return verdict_word(self.difference, self.better)


def seed_values(runs: pd.DataFrame, method: str, epsilon: float, metric: str) -> dict[int, float]:
    """One method's ``metric`` at ``epsilon`` by seed, from a :func:`records_frame`."""
    rows = runs[(runs["method"] == method) & (runs["epsilon"] == epsilon)]
    return {int(r): float(v) for r, v in zip(rows["replicate"], rows[metric], strict=True)}


def compare(
    runs: pd.DataFrame, metric: str, epsilon: float, better: str | None = None
) -> Comparison | None:
    """Best and runner-up mean of ``metric`` at ``epsilon`` over the runs of a
    :func:`records_frame` (or any frame of method, epsilon, replicate and ``metric``), with
    their difference's interval and test. ``better``: "max" or "min" (default: the
    metric's direction in SUMMARISED)."""
    better = better or SUMMARISED[metric]
    at = runs[(runs["epsilon"] == epsilon) & runs[metric].notna()]
    if at.empty:
        return None
    means = at.groupby("method", sort=False)[metric].mean()
    ranked = means.sort_values(ascending=better == "min", kind="mergesort")
    values = {m: seed_values(at, m, epsilon, metric) for m in ranked.index}
    best = str(ranked.index[0])
    second = str(ranked.index[1]) if len(ranked) > 1 else None
    return Comparison(
        metric,
        epsilon,
        better,
        best,
        float(ranked.iloc[0]),
        second,
        math.nan if second is None else float(ranked.iloc[1]),
        None if second is None else seed_difference(values[best], values[second]),
    )


def verdict_epsilons(table: pd.DataFrame) -> list[float]:
    """The smallest and largest finite epsilon (one if equal; inf if there is no finite)."""
    epsilons = sorted(set(table["epsilon"])) if not table.empty else []
    finite = [e for e in epsilons if math.isfinite(e)]
    if not finite:
        return epsilons[:1]
    return sorted({finite[0], finite[-1]})


def pooled_reliability(diagrams: Sequence[ReliabilityDiagram]) -> ReliabilityDiagram:
    """The diagram of all seeds' test predictions together (bin sums added up)."""
    count = np.sum([d.bin_count for d in diagrams], axis=0)
    correct = np.sum([np.nan_to_num(d.bin_accuracy) * d.bin_count for d in diagrams], axis=0)
    confidence = np.sum([np.nan_to_num(d.bin_confidence) * d.bin_count for d in diagrams], axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return ReliabilityDiagram(
            bin_edges=diagrams[0].bin_edges,
            bin_accuracy=np.where(count > 0, correct / count, np.nan),
            bin_confidence=np.where(count > 0, confidence / count, np.nan),
            bin_count=count.astype(np.int64),
        )
