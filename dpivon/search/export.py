"""Find a finished sweep and turn its Pareto-optimal trials into production configs.

The sweep is read wherever it is stored (a local folder, ``s3://``, ``gs://``: see
:mod:`dpivon.orchestration.storage`); trial checkpoints on remote storage are downloaded to a
temporary folder to be read.

An exported config is the trial's complete TrainConfig (read from the trial's own model
checkpoint, not re-assembled from strings), with the production epochs and, by default, the
full training set. It holds epsilon and delta, not sigma_p: `dpivon train` recalibrates the
noise for the production epochs, data size and batch size, so the production training
spends at most its epsilon. That is not the cost of the released model: its hyper-parameters
were chosen by the sweep on the same records, so the config carries the sweep's tuning cost
(`tuning`) and `dpivon train` reports the composition of both. A sweep with ``release:
best`` declared one pick (the best by its metric); any other pick (``knee``, ``pareto``:
a selection that depends on the whole front, or several models) is not what the
random-trials bound covers, so its configs carry the composition of all the group's
trials instead (read from the sweep's private ``tuning_private.json``). Exported configs run
with secure noise (dpivon.privacy.noise) unless ``research_mode`` is asked for: a released
model's noise must not be reproducible from a logged seed.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from dpivon.config import TrainConfig, TuningCost
from dpivon.errors import DpivonError, first_line
from dpivon.orchestration.storage import ResultsStorage, local_copy
from dpivon.runs.result import epsilon_with_tuning, tuning_touched
from dpivon.runs.setup import privacy_plan
from dpivon.search.pareto import pick
from dpivon.search.pipeline import load_pipeline
from dpivon.search.sweep import SweepState
from dpivon.search.sweep_files import FRONT_FILE, PRIVATE_TUNING_FILE, TRIALS_FILE, TUNING_FILE
from dpivon.search.trial import MODEL_FILE
from dpivon.tracking.model_file import load_model_file

DEFAULT_STORAGE = "dpivon-runs"


def resolve_sweep(sweep: str) -> ResultsStorage:
    """A sweep folder or URI (holding the state file), a pipeline file, or a sweep name
    under ./dpivon-runs."""
    if "://" in sweep or Path(sweep).is_dir():
        found = ResultsStorage.at(sweep)
    elif Path(sweep).is_file() and Path(sweep).suffix in (".yaml", ".yml"):
        found = load_pipeline(sweep).storage
    else:
        found = ResultsStorage(DEFAULT_STORAGE, sweep)
    if SweepState.exists(found):
        return found
    state_file = SweepState.file_name
    raise DpivonError(
        f"no sweep found for {sweep!r} (no {found.uri}/{state_file}): pass a sweep folder or "
        f"URI (holding {state_file}), the pipeline file, or the name of a sweep under "
        f"{DEFAULT_STORAGE}/"
    )


def load_results(storage: ResultsStorage) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(trials, front) tables of a finished sweep."""
    if not storage.exists(FRONT_FILE):
        raise DpivonError(
            f"sweep in {storage.uri} has no results yet (no {FRONT_FILE}); it is still "
            "running or was interrupted: finish it with `dpivon sweep PIPELINE --resume`"
        )
    trials, front = (_read_table(storage, name) for name in (TRIALS_FILE, FRONT_FILE))
    return trials, front


# what every trial row holds; a front row also names its final checkpoint
TABLE_COLUMNS = {
    TRIALS_FILE: ("trial_id", "group", "optimizer", "epsilon"),
    FRONT_FILE: ("trial_id", "group", "optimizer", "epsilon", "checkpoint"),
}


def _read_table(storage: ResultsStorage, name: str) -> pd.DataFrame:
    """One results table, its columns checked: a damaged one is named in one line."""
    where = storage.location(name)
    # identifiers stay text: Tune's trial ids may be all digits ("06927759")
    ids = dict.fromkeys(("trial_id", "run_id", "group"), str)
    try:
        table = pd.read_csv(io.BytesIO(storage.read_bytes(name)), dtype=ids)
    except (ValueError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise DpivonError(
            f"sweep table {where} is not a CSV table dpivon wrote ({first_line(err)})"
        ) from None
    missing = [c for c in TABLE_COLUMNS[name] if c not in table.columns]
    if missing:
        raise DpivonError(
            f"sweep table {where} lacks the column(s) {', '.join(missing)}: it was edited or "
            "damaged; `dpivon sweep PIPELINE --resume` on the finished sweep writes it again"
        )
    return table


def trial_config(storage: ResultsStorage, row: pd.Series) -> TrainConfig:
    """The complete config a trial trained with, from its final checkpoint (named inside
    the sweep's folder, wherever that folder is now)."""
    with local_copy(storage.location(row["checkpoint"])) as checkpoint:
        config, _, _ = load_model_file(checkpoint / MODEL_FILE)
    return config


def departure(storage: ResultsStorage, how: str | None) -> str | None:
    """Why ``--pick how`` is not covered by a ``release: best`` sweep's random-trials bound
    (one line), or None: the sweep declared no release pick, or ``how`` is it."""
    declared = SweepState.load(storage).release_pick
    if declared is None or how in (None, declared):
        return None
    return (
        f"--pick {how} is not the model the sweep releases (release: best, --pick {declared}): "
        "the random-trials bound does not cover this selection, so the exported configs "
        "carry the composition of all the group's trials instead"
    )


def _composition_cost(storage: ResultsStorage, group: str, report: dict, why: str) -> dict:
    """The composition in place of a random-trials bound (from the private facts)."""
    if not storage.exists(PRIVATE_TUNING_FILE):
        raise DpivonError(
            f"sweep in {storage.uri} has no {PRIVATE_TUNING_FILE}; finish it with `dpivon "
            "sweep PIPELINE --resume`, or export the sweep's own pick"
        )
    facts = storage.read_json(PRIVATE_TUNING_FILE)[group]
    return {
        **report,
        "quoted_epsilon": facts["composition_epsilon"],
        "quoted_rdp": facts["composition_rdp"],
        "quote": f"composition_epsilon: {why}.",
    }


def tuning_cost(
    storage: ResultsStorage, group: str, departs: str | None = None
) -> TuningCost | None:
    """The tuning cost of ``group`` from the sweep's report (None for non-private groups);
    ``departs`` (see :func:`departure`): the composition instead of a random-trials bound."""
    if not storage.exists(TUNING_FILE):
        raise DpivonError(
            f"sweep in {storage.uri} has no {TUNING_FILE}; finish it with `dpivon sweep "
            "PIPELINE --resume` (its tuning cost is part of every exported config)"
        )
    report = storage.read_json(TUNING_FILE).get(group)
    if report is None:
        return None
    if departs is not None and "random_trials_epsilon" in report:
        report = _composition_cost(storage, group, report, departs)
    return TuningCost(
        sweep=storage.name,
        group=group,
        quoted_epsilon=report["quoted_epsilon"],
        quote=report["quote"],
        release=report["release"],
        records_covered=report["records_covered"],
        quoted_rdp=report["quoted_rdp"],
    )


def target_config(trial: TrainConfig, batch_divisor: int, budget: float) -> TrainConfig:
    """The run a noise-faithful trial stood for: its batch times k, one pass an epoch, and
    the noise calibrated to the group's ``budget`` (the trial ran the target's steps and
    sigma / B at batch / k with a fixed sigma and its own, larger, epsilon)."""
    return trial.replace(
        batch_size=trial.training.batch_size * batch_divisor,
        steps_per_epoch=None,
        fixed_noise_multiplier=None,
        epsilon=budget,
    )


def production_config(
    config: TrainConfig,
    *,
    epochs: int | None,
    full_data: bool,
    tuning: TuningCost | None = None,
    research_mode: bool = False,
) -> TrainConfig:
    update: dict[str, Any] = {"tuning": tuning, "research_mode": research_mode}
    if epochs is not None:
        update["epochs"] = epochs
    if full_data and config.data.dataset == "cifar10":
        update.update(per_class=None, val_size=5000)
    return config.replace(**update)


def export_configs(
    storage: ResultsStorage,
    objectives: list[tuple[str, str]],
    how: str | None,
    *,
    optimizer: str | None = None,
    epsilon: float | None = None,
    epochs: int | None = None,
    full_data: bool = True,
    research_mode: bool = False,
) -> list[tuple[dict[str, Any], TrainConfig]]:
    """Picked trials per (optimizer, epsilon) group, with their production configs.

    ``how`` None: the sweep's release pick (``release: best``), else ``knee``. ``epsilon``
    is a group's budget (with ``total_epsilon``, the total; not what each trial spent).
    """
    departs = departure(storage, how)
    state = SweepState.load(storage)
    how = how or state.release_pick or "knee"
    _, front = load_results(storage)
    unscored = [m for m, _ in objectives if m not in front.columns]
    if unscored:
        raise DpivonError(
            f"sweep table {storage.location(FRONT_FILE)} has no column for the objective(s) "
            f"{', '.join(unscored)}: it was edited, or the objectives are another sweep's"
        )
    if optimizer is not None:
        front = front[front["optimizer"] == optimizer]
    if epsilon is not None:
        front = front[front["epsilon"] == epsilon]
    if front.empty:
        raise DpivonError("no Pareto-optimal trial matches the --optimizer/--epsilon filters")
    picked = []
    for _, group in front.groupby(["optimizer", "epsilon"]):
        for _, row in pick(group, objectives, how).iterrows():
            trial = trial_config(storage, row)
            if state.batch_divisor is not None and trial.is_private:
                trial = target_config(trial, state.batch_divisor, float(row["epsilon"]))
            config = production_config(
                trial,
                epochs=epochs,
                full_data=full_data,
                tuning=tuning_cost(storage, row["group"], departs),
                research_mode=research_mode,
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
            f"# trial {row['trial_id']} ({config.optimizer.name}, eps "
            f"{config.privacy.epsilon:g}): {scores}"
        )
        if (tuning := config.privacy.tuning) is not None:
            plan = privacy_plan(config, config.data.train_size)
            lines += [
                f"#   epsilon {config.privacy.epsilon:g} this training; epsilon "
                f"{epsilon_with_tuning(plan, plan.steps, tuning):.6g} end to end (composed "
                f"with tuning epsilon {tuning.quoted_epsilon:.6g}; `dpivon train` reports both)",
                f"#   {tuning_touched(tuning, config.data)}",
            ]
    documents = [c.model_dump(mode="json") for _, c in picked]
    body = yaml.safe_dump(documents[0] if len(documents) == 1 else documents, sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" + body)
