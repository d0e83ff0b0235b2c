"""Tests for Pareto fronts, hypervolume, knee points, picks, plots and the front table."""

from __future__ import annotations

import itertools
import re

import moocore
import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread
from pareto_reference import brute_force_front
from rich.console import Console
from rich.table import Table

from dpivon.errors import DpivonError
from dpivon.search.pareto import (
    DEFAULT_REFERENCE,
    default_reference,
    hypervolume_2d,
    knee_point,
    non_dominated_mask,
    pareto_front,
    pick,
)
from dpivon.search.pareto_views import format_front_table, plot_fronts_html, plot_fronts_png
from dpivon.search.pipeline import METRIC_MODES

OBJ = [("val_accuracy", "max"), ("val_ece", "min")]
MODE_SETS = [("max", "min"), ("min", "min"), ("max", "max"), ("min", "max")]


def random_values(rng: np.random.Generator, n: int, k: int = 2, *, coarse: bool) -> np.ndarray:
    # coarse: few distinct values, so many ties and exact duplicates
    values = rng.integers(0, 6, size=(n, k)) / 5 if coarse else rng.random((n, k))
    if n > 3:
        values[rng.integers(0, n)] = values[rng.integers(0, n)]  # an exact duplicate row
    return values


def make_trials(rng: np.random.Generator, n: int, *, coarse: bool = False) -> pd.DataFrame:
    values = random_values(rng, n, coarse=coarse)
    return pd.DataFrame(
        {
            "trial_id": [f"t{i:03d}" for i in range(n)],
            "optimizer": rng.choice(["dp-sgd", "dp-ivon-gradsq", "dp-adam"], size=n),
            "epsilon": rng.choice([1.0, 8.0, np.inf], size=n),
            "status": rng.choice(
                ["completed", "early_stopped", "failed"], size=n, p=[0.7, 0.2, 0.1]
            ),
            "val_accuracy": values[:, 0],
            "val_ece": values[:, 1] * 0.3,
            "test_accuracy": rng.random(n),
            "lr": 10 ** rng.uniform(-3, 0, size=n),
            "batch_size": rng.choice([256, 512, 1024], size=n),
        }
    )


# --------------------------------------------------------------------------- mask


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("modes", MODE_SETS)
@pytest.mark.parametrize("coarse", [False, True])
def test_mask_matches_brute_force(seed, modes, coarse):
    rng = np.random.default_rng(seed)
    values = random_values(rng, int(rng.integers(1, 120)), coarse=coarse)
    np.testing.assert_array_equal(
        non_dominated_mask(values, modes), brute_force_front(values, modes)
    )


@pytest.mark.parametrize("seed", range(3))
def test_mask_three_objectives_and_nan(seed):
    rng = np.random.default_rng(seed)
    values = random_values(rng, 60, k=3, coarse=True)
    values[rng.integers(0, 60, size=5), rng.integers(0, 3, size=5)] = np.nan
    modes = ("max", "min", "min")
    np.testing.assert_array_equal(
        non_dominated_mask(values, modes), brute_force_front(values, modes)
    )


def test_mask_large_input():
    rng = np.random.default_rng(0)
    values = random_values(rng, 2500, coarse=False)
    mask = non_dominated_mask(values, ("max", "min"))
    # cheap exact check for 2-D: sort by x descending, keep running min of y
    order = np.lexsort((values[:, 1], -values[:, 0]))
    expected = np.zeros(len(values), dtype=bool)
    best_y = np.inf
    for i in order:
        if values[i, 1] < best_y:
            expected[i] = True
            best_y = values[i, 1]
    np.testing.assert_array_equal(mask, expected)


def test_mask_duplicates_and_nan():
    values = np.array([[0.9, 0.1], [0.9, 0.1], [0.5, 0.05], [np.nan, 0.0], [0.95, np.nan]])
    assert non_dominated_mask(values, ("max", "min")).tolist() == [True, True, True, False, False]
    assert non_dominated_mask(np.empty((0, 2)), ("max", "min")).tolist() == []


def test_mask_rejects_bad_modes():
    with pytest.raises(DpivonError):
        non_dominated_mask(np.zeros((3, 2)), ("max", "up"))
    with pytest.raises(DpivonError):
        non_dominated_mask(np.zeros((3, 2)), ("max",))


# --------------------------------------------------------------------------- front


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("coarse", [False, True])
def test_front_matches_brute_force_on_completed(seed, coarse):
    trials = make_trials(np.random.default_rng(seed), 80, coarse=coarse)
    front = pareto_front(trials, OBJ)
    done = trials[trials["status"] == "completed"]
    expected = done.index[
        brute_force_front(done[["val_accuracy", "val_ece"]].to_numpy(), ("max", "min"))
    ]
    assert sorted(front.index) == sorted(expected)
    assert front["on_front"].all()
    assert (front["status"] == "completed").all()
    assert front["val_accuracy"].is_monotonic_decreasing
    # the result keeps every column of the trial table
    assert set(trials.columns) <= set(front.columns)


def test_early_stopped_and_failed_never_on_front_even_if_dominating():
    trials = pd.DataFrame(
        {
            "trial_id": ["a", "b", "c", "d"],
            "status": ["completed", "early_stopped", "failed", "completed"],
            "val_accuracy": [0.6, 0.99, 0.99, 0.5],
            "val_ece": [0.05, 0.001, 0.0, 0.02],
        }
    )
    front = pareto_front(trials, OBJ)
    assert front["trial_id"].tolist() == ["a", "d"]


def test_no_completed_trial_gives_empty_front_and_pick_error():
    trials = pd.DataFrame(
        {"status": ["failed", "early_stopped"], "val_accuracy": [0.1, 0.2], "val_ece": [0.1, 0.2]}
    )
    front = pareto_front(trials, OBJ)
    assert front.empty and "on_front" in front.columns
    with pytest.raises(DpivonError, match="no completed trial on the Pareto front"):
        pick(front, OBJ, "knee")


@pytest.mark.parametrize("seed", range(4))
def test_grouped_front_is_per_group_front(seed):
    trials = make_trials(np.random.default_rng(seed), 150, coarse=seed % 2 == 1)
    by = ("optimizer", "epsilon")
    front = pareto_front(trials, OBJ, by=by)
    for key, group in trials.groupby(list(by)):
        expected = pareto_front(group, OBJ)
        got = front[(front["optimizer"] == key[0]) & (front["epsilon"] == key[1])]
        assert list(got.index) == list(expected.index)
    # sorted by group, then best accuracy first inside each group
    for _, got in front.groupby(list(by), sort=False):
        assert got["val_accuracy"].is_monotonic_decreasing
    keys = list(zip(front["optimizer"], front["epsilon"], strict=True))
    assert keys == sorted(keys)


def test_front_errors():
    trials = make_trials(np.random.default_rng(0), 10)
    with pytest.raises(DpivonError, match="val_nll"):
        pareto_front(trials, [("val_accuracy", "max"), ("val_nll", "min")])
    with pytest.raises(DpivonError):
        pareto_front(trials, [("val_accuracy", "max")])
    with pytest.raises(DpivonError):
        pareto_front(trials, [("val_accuracy", "max"), ("val_ece", "lowest")])


# --------------------------------------------------------------------------- hypervolume


def test_hypervolume_hand_computed():
    pts = np.array([[0.5, 0.2], [0.7, 0.4]])
    assert hypervolume_2d(pts, ("max", "min"), (0.0, 1.0)) == pytest.approx(0.52)
    # a dominated point, a duplicate and a NaN add nothing
    more = np.vstack([pts, [[0.4, 0.5], [0.5, 0.2], [np.nan, 0.1]]])
    assert hypervolume_2d(more, ("max", "min"), (0.0, 1.0)) == pytest.approx(0.52)
    assert hypervolume_2d(pts[:1], ("max", "min"), (0.0, 1.0)) == pytest.approx(0.4)
    assert hypervolume_2d(pts, ("max", "min")) == pytest.approx(0.52)  # default (0, 1)
    # points outside the reference box contribute nothing
    assert hypervolume_2d(np.array([[0.5, 1.2]]), ("max", "min"), (0.0, 1.0)) == 0.0
    assert hypervolume_2d(np.empty((0, 2)), ("max", "min"), (0.0, 1.0)) == 0.0


def test_hypervolume_other_modes():
    # both minimised: boxes [1,3]x[2,3] and [2,3]x[1,3]; union 2 + 2 - 1 = 3
    pts = np.array([[1.0, 2.0], [2.0, 1.0]])
    assert hypervolume_2d(pts, ("min", "min"), (3.0, 3.0)) == pytest.approx(3.0)
    # both maximised with reference (0, 0): [0,1]x[0,2] U [0,2]x[0,1] = 3
    assert hypervolume_2d(pts, ("max", "max"), (0.0, 0.0)) == pytest.approx(3.0)


@pytest.mark.parametrize("seed", range(5))
def test_hypervolume_matches_grid_estimate(seed):
    rng = np.random.default_rng(seed)
    pts = rng.random((15, 2))
    grid = (np.arange(400) + 0.5) / 400
    gx, gy = np.meshgrid(grid, grid)
    covered = np.zeros_like(gx, dtype=bool)
    for acc, ece in pts:  # accuracy max, ECE min, reference (0, 1)
        covered |= (gx <= acc) & (gy >= ece)
    expected = covered.mean()
    assert hypervolume_2d(pts, ("max", "min"), (0.0, 1.0)) == pytest.approx(expected, abs=5e-3)


def brute_force_hypervolume(points: np.ndarray, modes, reference) -> float:
    """Exact area of the union of the boxes [point, reference], summed cell by cell over the
    grid that the points' and the reference's coordinates cut the plane into."""
    signs = np.array([-1.0 if m == "max" else 1.0 for m in modes])
    pts, ref = np.asarray(points, dtype=float) * signs, np.asarray(reference, dtype=float) * signs
    pts = pts[~np.isnan(pts).any(axis=1) & (pts < ref).all(axis=1)]
    xs = np.unique(np.append(pts[:, 0], ref[0]))
    ys = np.unique(np.append(pts[:, 1], ref[1]))
    area = 0.0
    for x0, x1 in itertools.pairwise(xs):
        for y0, y1 in itertools.pairwise(ys):
            if any(px <= x0 and py <= y0 for px, py in pts):  # cell inside some point's box
                area += (x1 - x0) * (y1 - y0)
    return area


def test_brute_force_hypervolume_hand_computed():
    pts = np.array([[0.5, 0.2], [0.7, 0.4], [0.4, 0.5], [0.5, 1.2]])
    assert brute_force_hypervolume(pts, ("max", "min"), (0.0, 1.0)) == pytest.approx(0.52)
    assert brute_force_hypervolume(pts[:0], ("max", "min"), (0.0, 1.0)) == 0.0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("modes", MODE_SETS)
@pytest.mark.parametrize("coarse", [False, True])
def test_moocore_front_and_hypervolume_match_brute_force(seed, modes, coarse):
    """moocore (and the wrappers over it) against the O(n^2) front and the cell-by-cell area,
    with ties, duplicates, points outside the reference box and a NaN row."""
    rng = np.random.default_rng(100 + seed)
    values = random_values(rng, int(rng.integers(1, 50)), coarse=coarse)
    maximise = [m == "max" for m in modes]
    ref = tuple(0.2 if m == "max" else 0.8 for m in modes)  # some points fall outside
    expected_front = brute_force_front(values, modes)
    np.testing.assert_array_equal(
        moocore.is_nondominated(values, maximise=maximise, keep_weakly=True), expected_front
    )
    np.testing.assert_array_equal(non_dominated_mask(values, modes), expected_front)
    expected = brute_force_hypervolume(values, modes, ref)
    assert moocore.hypervolume(values, ref=ref, maximise=maximise) == pytest.approx(expected)
    assert hypervolume_2d(values, modes, ref) == pytest.approx(expected)
    # the front alone has the same hypervolume; a NaN row changes nothing
    assert hypervolume_2d(values[expected_front], modes, ref) == pytest.approx(expected)
    with_nan = np.vstack([values, [np.nan, 0.5]])
    assert hypervolume_2d(with_nan, modes, ref) == pytest.approx(expected)
    assert brute_force_hypervolume(with_nan, modes, ref) == pytest.approx(expected)


def test_default_reference():
    assert default_reference(OBJ) == (0.0, 1.0)
    assert DEFAULT_REFERENCE["val_brier"] == 2.0
    # every metric a sweep may choose as an objective has one
    assert set(METRIC_MODES) <= set(DEFAULT_REFERENCE)
    assert default_reference([("val_shift_ece", "min"), ("val_accuracy", "max")]) == (1.0, 0.0)
    with pytest.raises(DpivonError):
        default_reference([("val_accuracy", "max"), ("wall_time_s", "min")])


# --------------------------------------------------------------------------- knee / pick


def front_frame(points) -> pd.DataFrame:
    pts = np.asarray(points, dtype=float)
    return pd.DataFrame(
        {
            "trial_id": [f"k{i}" for i in range(len(pts))],
            "status": "completed",
            "val_accuracy": pts[:, 0],
            "val_ece": pts[:, 1],
        },
        index=[f"row{i}" for i in range(len(pts))],
    )


def test_knee_of_l_shaped_front_is_corner():
    # accuracy rises fast while ECE stays low, then ECE explodes for a little accuracy
    pts = [(0.50, 0.02), (0.60, 0.025), (0.70, 0.03), (0.72, 0.10), (0.73, 0.20), (0.74, 0.30)]
    front = front_frame(pts)
    assert knee_point(front, OBJ) == "row2"
    # shuffled rows: the same label
    assert knee_point(front.sample(frac=1.0, random_state=1), OBJ) == "row2"


def test_knee_small_and_straight_fronts():
    assert knee_point(front_frame([(0.5, 0.1)]), OBJ) == "row0"
    assert knee_point(front_frame([(0.5, 0.1), (0.7, 0.2)]), OBJ) == "row1"
    straight = front_frame([(0.5, 0.1), (0.6, 0.2), (0.7, 0.3)])
    assert knee_point(straight, OBJ) == "row2"  # nothing bulges: best accuracy
    with pytest.raises(DpivonError):
        knee_point(front_frame(np.empty((0, 2))), OBJ)


@pytest.mark.parametrize("seed", range(20))
def test_knee_is_always_a_front_member(seed):
    rng = np.random.default_rng(seed)
    trials = make_trials(rng, int(rng.integers(1, 60)), coarse=seed % 3 == 0)
    trials.loc[trials.index[0], "status"] = "completed"
    front = pareto_front(trials, OBJ)
    assert knee_point(front, OBJ) in front.index
    for _, group in pareto_front(trials, OBJ, by=("optimizer", "epsilon")).groupby(
        ["optimizer", "epsilon"]
    ):
        assert knee_point(group, OBJ) in group.index


def test_pick_modes():
    pts = [(0.50, 0.02), (0.60, 0.025), (0.70, 0.03), (0.72, 0.10), (0.74, 0.30)]
    front = front_frame(pts)
    assert pick(front, OBJ, "knee").index.tolist() == ["row2"]
    assert pick(front, OBJ, "max-accuracy").index.tolist() == ["row4"]
    assert pick(front, OBJ, "min-ece").index.tolist() == ["row0"]
    assert pick(front, OBJ, "pareto").index.tolist() == front.index.tolist()
    with pytest.raises(DpivonError, match="knee, max-accuracy, min-ece, pareto"):
        pick(front, OBJ, "best")


def test_pick_per_group():
    trials = make_trials(np.random.default_rng(3), 200)
    by = ("optimizer", "epsilon")
    front = pareto_front(trials, OBJ, by=by)
    groups = front.groupby(list(by)).ngroups
    for how in ("knee", "max-accuracy", "min-ece"):
        chosen = pick(front, OBJ, how, by=by)
        assert len(chosen) == groups
        assert chosen.index.isin(front.index).all()
    best = pick(front, OBJ, "max-accuracy", by=by)
    for _, row in best.iterrows():
        same = front[
            (front["optimizer"] == row["optimizer"]) & (front["epsilon"] == row["epsilon"])
        ]
        assert row["val_accuracy"] == same["val_accuracy"].max()


# --------------------------------------------------------------------------- output


def degenerate_trials() -> pd.DataFrame:
    trials = make_trials(np.random.default_rng(7), 40)
    extra = pd.DataFrame(
        {
            "trial_id": ["solo", "dead1", "dead2", "nan"],
            "optimizer": ["dp-solo", "dp-dead", "dp-dead", "dp-sgd"],
            "epsilon": [2.0, 2.0, 2.0, 2.0],
            "status": ["completed", "failed", "early_stopped", "failed"],
            "val_accuracy": [0.4, np.nan, 0.3, np.nan],
            "val_ece": [0.05, np.nan, 0.1, np.nan],
            "test_accuracy": [0.4, np.nan, np.nan, np.nan],
            "lr": [0.1, 0.2, 0.3, 0.4],
            "batch_size": [512, 512, 512, 512],
        }
    )
    return pd.concat([trials, extra], ignore_index=True)


def test_plot_png(tmp_path, monkeypatch):
    """Each epsilon's panel draws every trial and, per optimizer, the brute-force front of its
    completed trials as a step line from the most accurate point: (a1, e1) (a2, e1) (a2, e2)..."""
    saved = []
    savefig = Figure.savefig

    def keep_figure(fig, *args, **kwargs):  # the real savefig, with the figure kept to read
        saved.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep_figure)
    path = tmp_path / "plots" / "fronts.png"
    trials = degenerate_trials()
    plot_fronts_png(trials, OBJ, path, "DP optimizers: accuracy vs ECE")
    image = imread(path)
    assert image.ndim == 3 and image.shape[1] > image.shape[0]
    (fig,) = saved
    panels = trials.groupby("epsilon", sort=True)
    optimizers = sorted(trials["optimizer"].unique())
    titles = ["epsilon = 1", "epsilon = 2", "epsilon = 8", "non-private (epsilon = inf)"]
    assert [ax.get_title() for ax in fig.axes] == titles
    fronts = 0
    for ax, (_, panel) in zip(fig.axes, panels, strict=True):
        drawn = np.concatenate([c.get_offsets() for c in ax.collections])
        drawn = {tuple(xy) for xy in drawn if not np.isnan(xy).any()}
        everything = panel[["val_accuracy", "val_ece"]].dropna().to_numpy()
        assert drawn == {tuple(xy) for xy in everything}
        lines = {line.get_color(): line for line in ax.lines}
        for i, name in enumerate(optimizers):
            done = panel[(panel.optimizer == name) & (panel.status == "completed")]
            values = done[["val_accuracy", "val_ece"]].to_numpy()
            front = sorted(
                map(tuple, values[brute_force_front(values, ("max", "min"))]),
                key=lambda p: (-p[0], p[1]),
            )
            steps = [p for a, b in itertools.pairwise(front) for p in (a, (b[0], a[1]))]
            steps += front[-1:]
            np.testing.assert_array_equal(
                lines[f"C{i}"].get_xydata().reshape(-1, 2),
                np.array(steps).reshape(-1, 2),
                err_msg=f"front of {name}",
            )
            fronts += len(front) > 0
    assert fronts > len(fig.axes)  # more than one optimizer's front per panel


def test_plot_png_single_point_and_no_epsilon(tmp_path):
    one = front_frame([(0.5, 0.1)]).assign(optimizer="dp-sgd")
    plot_fronts_png(one, OBJ, tmp_path / "one.png", "one trial")
    assert imread(tmp_path / "one.png").size > 0
    none_done = one.assign(status="failed", epsilon=8.0)
    plot_fronts_png(none_done, OBJ, tmp_path / "none.png", "no completed trial")
    assert imread(tmp_path / "none.png").size > 0


def test_plot_html(tmp_path):
    path = tmp_path / "fronts.html"
    trials = degenerate_trials()
    plot_fronts_html(trials, OBJ, path, "DP optimizers: accuracy vs ECE")
    html = path.read_text(encoding="utf-8")
    assert "plotly" in html
    assert not re.search(r"<script[^>]*\bsrc=", html)  # plotly.js embedded: works offline
    assert len(html) > 1_000_000
    assert "trial_id: solo" in html and "lr: " in html and "batch_size: " in html
    assert "test_accuracy" not in html  # hover shows hyper-parameters, not other metrics
    one = front_frame([(0.5, 0.1)]).assign(status="early_stopped")
    plot_fronts_html(one, OBJ, tmp_path / "one.html", "nothing completed")
    assert "plotly" in (tmp_path / "one.html").read_text(encoding="utf-8")


def test_front_table():
    trials = make_trials(np.random.default_rng(1), 60)
    front = pareto_front(trials, OBJ, by=("optimizer", "epsilon"))
    table = format_front_table(front, OBJ, ["lr", "batch_size", "missing"])
    assert isinstance(table, Table)
    assert table.row_count == len(front)
    headers = [str(c.header) for c in table.columns]
    assert headers[:3] == ["optimizer", "epsilon", "trial_id"]  # all front rows are completed
    assert "val_accuracy ↑" in headers and "val_ece ↓" in headers
    assert headers[-2:] == ["lr", "batch_size"]
    console = Console(record=True, width=160)
    console.print(table)
    assert front["trial_id"].iloc[0] in console.export_text()


def test_all_picks_work_on_every_combination_of_small_fronts():
    for n in range(1, 5):
        for pts in itertools.islice(
            itertools.combinations([(0.5, 0.1), (0.6, 0.2), (0.7, 0.4), (0.8, 0.8)], n), 3
        ):
            front = pareto_front(front_frame(pts), OBJ)
            for how in ("knee", "max-accuracy", "min-ece"):
                assert len(pick(front, OBJ, how)) == 1
