"""Find a finished sweep on disk and turn its Pareto-optimal trials into production configs.

An exported config is the trial's complete TrainConfig (read from the trial's own model
checkpoint, not re-assembled from strings), with the production epochs and, by default, the
full training set. It holds epsilon and delta, not sigma_p: `dpivon train` recalibrates the
noise for the production epochs, data size and batch size, so the production training
spends at most its epsilon. That is not the cost of the released model: its hyper-parameters
were chosen by the sweep on the same records, so the config carries the sweep's tuning cost
(`tuning`) and `dpivon train` reports the composition of both. Exported configs run in
secure mode (noise from OS entropy, never stored): a released model's noise must not be
reproducible from a logged seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml

from dpivon.config import TrainConfig, TuningCost
from dpivon.errors import DpivonError
from dpivon.search.pareto import pick
from dpivon.search.pipeline import load_pipeline
from dpivon.search.sweep import FRONT_FILE, STATE_FILE, TRIALS_FILE, TUNING_FILE, sweep_directory
from dpivon.search.trial import MODEL_FILE

DEFAULT_STORAGE = Path("dpivon-runs")


def resolve_sweep(sweep: str) -> Path:
    """A sweep folder, a pipeline file, or a sweep name under ./dpivon-runs."""
    path = Path(sweep)
    if path.is_dir() and (path / STATE_FILE).exists():
        return path
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        return sweep_directory(load_pipeline(path))
    if (DEFAULT_STORAGE / sweep / STATE_FILE).exists():
        return DEFAULT_STORAGE / sweep
    raise DpivonError(
        f"no sweep found for {sweep!r}: pass a sweep folder (holding {STATE_FILE}), the "
        f"pipeline file, or the name of a sweep under {DEFAULT_STORAGE}/"
    )


def load_results(directory: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(trials, front) tables of a finished sweep."""
    if not (directory / FRONT_FILE).exists():
        raise DpivonError(
            f"sweep in {directory} has no results yet (no {FRONT_FILE}); it is still running "
            "or was interrupted: finish it with `dpivon sweep PIPELINE --resume`"
        )
    return pd.read_csv(directory / TRIALS_FILE), pd.read_csv(directory / FRONT_FILE)


def trial_config(row: pd.Series) -> TrainConfig:
    state = torch.load(Path(row["checkpoint"]) / MODEL_FILE, map_location="cpu", weights_only=True)
    return TrainConfig.model_validate(state["config"])


def tuning_cost(directory: Path, group: str) -> TuningCost | None:
    """The tuning cost of ``group`` from the sweep's report (None for non-private groups)."""
    path = directory / TUNING_FILE
    if not path.exists():
        raise DpivonError(
            f"sweep in {directory} has no {TUNING_FILE}; finish it with `dpivon sweep "
            "PIPELINE --resume` (its tuning cost is part of every exported config)"
        )
    report = json.loads(path.read_text()).get(group)
    if report is None:
        return None
    return TuningCost(
        sweep=directory.name,
        group=group,
        quoted_epsilon=report["quoted_epsilon"],
        quote=report["quote"],
        release=report["release"],
        records_covered=report["records_covered"],
        quoted_rdp=report["quoted_rdp"],
    )


def production_config(
    config: TrainConfig,
    *,
    epochs: int | None,
    full_data: bool,
    tuning: TuningCost | None = None,
    secure_mode: bool = True,
) -> TrainConfig:
    update: dict[str, Any] = {"fail_at_epoch": None, "tuning": tuning, "secure_mode": secure_mode}
    if epochs is not None:
        update["epochs"] = epochs
    if full_data and config.dataset == "cifar10":
        update.update(per_class=None, val_size=5000)
    return TrainConfig.model_validate({**config.model_dump(), **update})


def export_configs(
    directory: Path,
    objectives: list[tuple[str, str]],
    how: str,
    *,
    optimizer: str | None = None,
    epsilon: float | None = None,
    epochs: int | None = None,
    full_data: bool = True,
    secure_mode: bool = True,
) -> list[tuple[dict[str, Any], TrainConfig]]:
    """Picked trials per (optimizer, epsilon) group, with their production configs."""
    _, front = load_results(directory)
    if optimizer is not None:
        front = front[front["optimizer"] == optimizer]
    if epsilon is not None:
        front = front[front["epsilon"] == epsilon]
    if front.empty:
        raise DpivonError("no Pareto-optimal trial matches the --optimizer/--epsilon filters")
    picked = []
    for _, group in front.groupby(["optimizer", "epsilon"]):
        for _, row in pick(group, objectives, how).iterrows():
            trial = trial_config(row)
            config = production_config(
                trial,
                epochs=epochs,
                full_data=full_data,
                tuning=tuning_cost(directory, row["group"]),
                secure_mode=secure_mode,
            )
            picked.append((row.to_dict(), config))
    return picked


def write_configs(
    path: Path,
    picked: list[tuple[dict[str, Any], TrainConfig]],
    objectives: list[tuple[str, str]],
    how: str,
) -> None:
    """One YAML mapping per config (a list when several), with where it came from."""
    lines = [f"# exported by `dpivon export --pick {how}`; run with: dpivon train --config {path}"]
    for row, config in picked:
        scores = ", ".join(f"{m}={row.get(m):.4f}" for m, _ in objectives if m in row)
        lines.append(
            f"# trial {row['trial_id']} ({config.optimizer}, eps {config.epsilon:g}): {scores}"
        )
        if config.tuning is not None:
            lines.append(
                f"#   chosen by sweep {config.tuning.sweep} ({config.tuning.group}) at tuning "
                f"epsilon {config.tuning.quoted_epsilon:.3g} on the same records: `dpivon "
                "train` reports the production epsilon composed with it"
            )
    documents = [c.model_dump(mode="json") for _, c in picked]
    body = yaml.safe_dump(documents[0] if len(documents) == 1 else documents, sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" + body)
