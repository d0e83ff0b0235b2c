"""Bad input, fuzzed: whatever a user writes in a file or on the command line loads or fails
with one line.

Hypothesis writes search-space files, pipeline files, training configs (mappings and YAML
files) and `dpivon train` / `sweep` / `export` command lines. Every input loads or raises a
DpivonError whose message is one line (naming the file it read); never another exception,
never a hang (a 20 s deadline per example, a timeout per test). A command line that must be
rejected before training exits non-zero with one line, no traceback, and no MLflow run.
Structure-aware mutations of every shipped pipeline, space and benchmark file, and command
lines drawn from each command's own options, join them. Derandomized, without an example
database: every CI run tries the same ~2,000 inputs.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import os
import sqlite3
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import optuna
import pytest
import typer
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from optuna.distributions import CategoricalDistribution
from sweep_helpers import shipped_run_files
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.config import TrainConfig, load_configs, parse_config
from dpivon.errors import DpivonError
from dpivon.search.pipeline import load_pipeline
from dpivon.search.space import load_search_space
from dpivon.study.spec import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
SPACE = ROOT / "search_spaces/quickstart/dp-sgd.yaml"

pytestmark = pytest.mark.timeout(180)  # a hang fails the test (deadlines time each example)
optuna.logging.set_verbosity(optuna.logging.WARNING)


def fuzz(examples: int) -> settings:
    """Derandomized, no example database: CI replays the same inputs every run."""
    return settings(
        max_examples=examples,
        deadline=timedelta(seconds=20),  # a hang, not a slow shared CI machine
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


# -- YAML as users write it ---------------------------------------------------------------------

# Scalars PyYAML reads in surprising ways (yes = true, 017 = 15, 1:30 = 90, a date), numbers
# out of range or not numbers at all, and text that is no YAML.
QUIRKS = (
    *("yes", "no", "on", "off", "y", "True", "FALSE", "null", "~", "''", "'yes'", '"128"'),
    *("1e-6", "-1E+3", "1e400", "-1e400", ".inf", "-.inf", ".nan", "inf", "-inf", "nan"),
    *("0x1F", "0o17", "017", "0b101", "1_000", "1:30", "2001-12-14", "-0", "+1", ".5", "5."),
    *("9" * 400, "[]", "{}", "[1, 2]", "{a: 1}", "[[]]", "!!binary aGk=", "!!str 3", "'1e-4'"),
    *("'", '"', "%x", "@", "`", "&a 1", "*nowhere", "? x", "- x", "{", "]", "#", "|", ">"),
    *("._", "!!float x", "!!int 1.5", "!!timestamp 2001-99-99", "9" * 5000, "[" * 600),
    # a billion laughs: 8**7 (2 million) leaves that YAML aliases make out of 56 numbers
    "[&a [1,1,1,1,1,1,1,1], "
    + ", ".join(f"&{b} [{', '.join([f'*{a}'] * 8)}]" for a, b in itertools.pairwise("abcdefg"))
    + "]",
)
NUMBER = st.one_of(
    st.integers(-(2**63), 2**63).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),  # repr: inf, nan, 5e-324
    st.floats(1e-12, 1e4).map(repr),
)
SCALAR = st.one_of(
    st.sampled_from(QUIRKS),
    NUMBER,
    st.text(alphabet="abxyz019.-+_eE: ", min_size=1, max_size=6),
)


def flow_list(items: list[str]) -> str:
    return "[" + ", ".join(items) + "]"


def flow_map(pairs: list[tuple[str, str]]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"


def as_file(text: st.SearchStrategy[str]) -> st.SearchStrategy[bytes]:
    """The text as UTF-8 mostly; else as UTF-16, cut short, random bytes or nothing."""

    def encode(form: int, text: str, cut: float, noise: bytes) -> bytes:
        return {
            0: text.encode("utf-16"),
            1: text[: int(cut * len(text))].encode(),
            2: noise,
            3: b"",
        }.get(form, text.encode())

    form = st.sampled_from(range(12))
    return st.builds(encode, form, text, st.floats(0, 1), st.binary(max_size=64))


# Tracking URIs that MLflow itself refuses (its own exceptions, turned into one line)
MLFLOW_ERROR_URIS = ("foo://bar", "mlflow://x", "file:///dev/null/mlruns", ":")


def assert_one_line(err: DpivonError, path: Path | None = None) -> None:
    message = str(err)
    assert message.strip() and "\n" not in message, repr(message)
    if path is not None:
        assert str(path) in message, message


def load_or_one_line_error(load: Callable[[Path], Any], path: Path, content: bytes) -> Any:
    """``load(path)`` once ``content`` is written there, or None when it refused the file
    in one line that names it (no loader returns None)."""
    path.write_bytes(content)
    try:
        return load(path)
    except DpivonError as err:
        assert_one_line(err, path)
        return None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A working directory for the module; one rejected command first imports what the
    commands import, which would otherwise eat the first example's deadline."""
    path = tmp_path_factory.mktemp("fuzz")
    with contextlib.chdir(path):
        CliRunner().invoke(app, ["train", "--epsilon=0"], env={"MLFLOW_TRACKING_URI": "sqlite://"})
    return path


# -- search-space files -------------------------------------------------------------------------

PARAM_NAMES = (
    *("lr", "batch_size", "beta2", "momentum", "weight_decay", "max_grad_norm", "hess_init"),
    *("mc_samples", "engine", "curvature_ema", "hess_floor", "epochs", "device", "use_wd"),
    *("optimizer.lr", "training.batch_size", "lrr", "optimizer", "1", "''", "a.b.c"),
)
SPEC_KEYS = ("type", "low", "high", "log", "step", "choices", "when", "lg")
TYPES = ("float", "int", "categorical", "floot", "[float]", "null", "1", "Float")
OPTIMIZERS = ("dp-sgd", "dp-adam", "dp-ivon-gradsq", "ivon", "sgd", "dp-sgdd", "[dp-sgd]", "3")


@st.composite
def spec_value(draw: st.DrawFn, key: str) -> str:
    if key == "type":
        return draw(st.sampled_from(TYPES))
    if key == "choices":
        return flow_list(draw(st.lists(SCALAR, max_size=4)))
    if key == "when":
        ref = draw(st.sampled_from(PARAM_NAMES))
        value = draw(st.one_of(SCALAR, st.lists(SCALAR, max_size=3).map(flow_list)))
        return flow_map([(ref, value)])
    if key == "log":
        return draw(st.sampled_from(("true", "false", "yes", "1", "null")))
    return draw(st.one_of(NUMBER, NUMBER, SCALAR))


@st.composite
def param_text(draw: st.DrawFn) -> str:
    if draw(st.integers(0, 3)) == 0:
        return draw(SCALAR)  # a fixed value
    keys = draw(st.lists(st.sampled_from(SPEC_KEYS[1:]), unique=True, max_size=4))
    if draw(st.integers(0, 5)) > 0:
        keys = ["type", *keys]
    return flow_map([(k, draw(spec_value(k))) for k in keys])


# A valid dp-sgd space (a float, an int grid, a categorical, a switch and the parameter it
# turns on, a fixed value) that the fuzzer mutates
SPACE_PARAMS = {
    "lr": {"type": "float", "low": "0.05", "high": "10.0", "log": "true"},
    "momentum": {"type": "categorical", "choices": "[0.0, 0.5, 0.9]"},
    "batch_size": {"type": "int", "low": "32", "high": "256", "step": "32"},
    "use_wd": {"type": "categorical", "choices": "[true, false]"},
    "weight_decay": {"type": "float", "low": "1e-6", "high": "1e-2", "when": "{use_wd: true}"},
    "max_grad_norm": "1.0",
}


# Values that keep a space well-formed, if not valid: numbers of every size and sign
# for bounds and steps, choices of numbers, conditions on the switch or on the int grid
NUMERIC = st.one_of(
    st.integers(-10, 2000).map(str),
    st.floats(-1, 1e3).map(repr),
    st.floats(1e-12, 1e12).map(repr),
)
WELL_FORMED = {
    "type": st.sampled_from(("float", "int", "categorical")),
    "low": NUMERIC,
    "high": NUMERIC,
    "step": NUMERIC,
    "log": st.sampled_from(("true", "false")),
    "choices": st.lists(NUMERIC, min_size=1, max_size=4).map(flow_list),
    "when": st.sampled_from(("{use_wd: true}", "{use_wd: [true, false]}", "{batch_size: 64}")),
}


@st.composite
def space_text(draw: st.DrawFn, well_formed: bool) -> str:
    """The space above with one to three changes: to its values only (``well_formed``), or
    to anything: names, keys, types, whole parameters, the optimizer, a stray line."""
    params = {n: p if isinstance(p, str) else dict(p) for n, p in SPACE_PARAMS.items()}
    for _ in range(draw(st.sampled_from((1, 1, 2, 3)))):
        name = draw(st.sampled_from([*params] if well_formed else [*params, *PARAM_NAMES]))
        spec = params.get(name)
        if well_formed:
            key = draw(st.sampled_from(sorted({*spec, "step"}))) if isinstance(spec, dict) else ""
            if key:
                spec[key] = draw(WELL_FORMED[key])
            else:
                params[name] = draw(NUMERIC)
        elif not isinstance(spec, dict) or draw(st.integers(0, 4)) == 0:
            params[name] = draw(param_text())
        elif draw(st.integers(0, 3)) == 0:
            spec.pop(draw(st.sampled_from(sorted(spec))), None)
        else:
            key = draw(st.sampled_from(SPEC_KEYS))
            spec[key] = draw(spec_value(key))
    optimizer = "dp-sgd" if well_formed else draw(st.sampled_from(("dp-sgd",) * 8 + OPTIMIZERS))
    lines = [f"optimizer: {optimizer}", "params:"]
    for name, spec in params.items():
        lines.append(f"  {name}: {spec if isinstance(spec, str) else flow_map(list(spec.items()))}")
    if not well_formed and draw(st.integers(0, 9)) == 0:
        lines.insert(draw(st.integers(0, len(lines))), f"{draw(SCALAR)}: {draw(SCALAR)}")
    return "\n".join(lines) + "\n"


def _inside(dist: Any, value: Any) -> bool:
    if isinstance(dist, CategoricalDistribution):
        return value in dist.choices
    return dist.low <= value <= dist.high


@fuzz(300)
@given(
    content=st.one_of(
        as_file(space_text(well_formed=False)), space_text(well_formed=True).map(str.encode)
    )
)
def test_a_space_file_loads_and_samples_or_fails_in_one_line(workdir, content):
    space = load_or_one_line_error(load_search_space, workdir / "space.yaml", content)
    if space is None:
        return
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(3):
        trial = study.ask()
        assert space.define_by_run(trial) == space.fixed
        assert all(_inside(space.distributions[n], v) for n, v in trial.params.items())
        assert space.trial_config(trial.params)["optimizer"] == space.optimizer
        study.tell(trial, 0.0)


# -- pipeline files -----------------------------------------------------------------------------

PIPELINE = {
    "name": "fuzz",
    "data": "{dataset: synthetic, synthetic_size: 600}",
    "model": "small-cnn",
    "epochs": "3",
    "epsilons": "[8]",
    "delta": "1e-5",
    "optimizers": f"[{{name: dp-sgd, space: {SPACE}}}]",
    "trials": "2",
    "scheduler": "none",
}
PIPELINE_VALUES = {
    "data": st.builds(
        lambda pairs: flow_map(pairs),
        st.lists(
            st.tuples(
                st.sampled_from(("dataset", "synthetic_size", "val_size", "per_class", "x")),
                st.one_of(st.sampled_from(("synthetic", "cifar10", "mnist")), NUMBER, SCALAR),
            ),
            max_size=3,
        ),
    ),
    "epsilons": st.one_of(SCALAR, st.lists(NUMBER, max_size=3).map(flow_list)),
    "optimizers": st.lists(
        st.tuples(
            st.sampled_from(OPTIMIZERS),
            st.sampled_from((str(SPACE), "nowhere.yaml", str(ROOT / "pipelines"), "''", "1")),
        ).map(lambda e: flow_map([("name", e[0]), ("space", e[1])])),
        max_size=2,
    ).map(flow_list),
    "scheduler": st.one_of(
        st.sampled_from(("none", "asha", "hyperband", "{type: asha, grace_period: 5}")),
        SCALAR,
    ),
    "resources": st.tuples(NUMBER, SCALAR).map(lambda r: flow_map([("cpu", r[0]), ("gpu", r[1])])),
    "objectives": st.lists(
        st.tuples(
            st.sampled_from(("val_accuracy", "val_ece", "val_nll", "test_ece")),
            st.sampled_from(("max", "min", "maximize")),
        ).map(lambda o: flow_map([("metric", o[0]), ("mode", o[1])])),
        max_size=3,
    ).map(flow_list),
    "train": st.lists(st.tuples(st.sampled_from(PARAM_NAMES), SCALAR), max_size=2).map(flow_map),
}
PIPELINE_KEYS = (
    *PIPELINE,
    *("resources", "objectives", "train", "total_epsilon", "release", "validation_noise"),
    *("accountant", "trial_count", "concurrency", "sampler", "seed", "tracking_uri"),
    *("experiment", "storage_path", "max_failures", "trails"),
)


@st.composite
def pipeline_text(draw: st.DrawFn) -> str:
    """A valid pipeline with some keys dropped, changed or added."""
    document = dict(PIPELINE)
    for key in draw(st.lists(st.sampled_from(PIPELINE_KEYS), unique=True, min_size=1, max_size=3)):
        if draw(st.integers(0, 4)) == 0:
            document.pop(key, None)
        else:
            document[key] = draw(PIPELINE_VALUES.get(key, SCALAR))
    return "".join(f"{key}: {value}\n" for key, value in document.items())


@fuzz(300)
@given(content=as_file(pipeline_text()))
def test_a_pipeline_file_loads_or_fails_in_one_line(workdir, content):
    pipeline = load_or_one_line_error(load_pipeline, workdir / "pipeline.yaml", content)
    assert pipeline is None or list(pipeline.spaces) == pipeline.optimizer_names


# -- training configs ---------------------------------------------------------------------------

INT_KEYS = ("epochs", "batch_size", "seed", "bma_samples", "ece_bins", "mc_samples")
INT_KEYS += ("synthetic_size", "val_size", "per_class", "data_seed")
FLOAT_KEYS = ("epsilon", "delta", "max_grad_norm", "lr", "weight_decay", "momentum", "beta2")
FLOAT_KEYS += ("hess_init", "hess_floor", "curvature_ema", "val_noise_multiplier")
TEXT_KEYS = ("dataset", "model", "optimizer", "device", "engine", "accountant", "data_path")
CONFIG_KEYS = (*INT_KEYS, *FLOAT_KEYS, *TEXT_KEYS, "research_mode", "optimizer.lr", "privacy")
VALUES = st.one_of(
    st.booleans(),
    st.none(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(("128", "1e-6", "yes", "inf", "cpu", "cuda:x", "dp-sgd", "synthetic", "")),
    st.lists(st.integers(0, 9), max_size=2),
    st.dictionaries(st.sampled_from(("epsilon", "lr", "x")), st.integers(0, 9), max_size=2),
)


def _wrong_type(key: str, value: Any) -> bool:
    """Whether ``value`` is no value of ``key``'s type (strict: no bool, no "3")."""
    if key in INT_KEYS:
        return type(value) is not int and value is not None
    if key in FLOAT_KEYS:
        return type(value) not in (int, float) and value is not None
    if key in TEXT_KEYS:  # a mapping is the section form: optimizer: {name: dp-sgd, lr: 1}
        return not isinstance(value, str | dict) and value is not None
    return False


@fuzz(250)
@given(values=st.dictionaries(st.sampled_from(CONFIG_KEYS), VALUES, max_size=5))
def test_a_training_config_is_strict_or_fails_in_one_line(values):
    data = {"dataset": "synthetic", "optimizer": "dp-sgd", **values}
    try:
        config = parse_config(data)
    except DpivonError as err:
        assert_one_line(err)
        return
    assert isinstance(config, TrainConfig)
    wrong = [k for k, v in data.items() if _wrong_type(k, v)]
    assert not wrong, f"accepted {wrong} of the wrong type: {data}"


@fuzz(150)
@given(
    content=as_file(
        st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), SCALAR), max_size=5).map(
            lambda pairs: "".join(f"{k}: {v}\n" for k, v in pairs)
        )
    )
)
def test_a_config_file_loads_or_fails_in_one_line(workdir, content):
    configs = load_or_one_line_error(load_configs, workdir / "config.yaml", content)
    assert configs is None or all(isinstance(c, TrainConfig) for c in configs)


# -- one quirk in one value of a valid file -----------------------------------------------------

# Valid files with one value marked @, for a quirk
QUIRK_SLOTS = (
    *(
        (load_search_space, f"optimizer: dp-sgd\nparams:\n  {slot}\n")
        for slot in (
            "lr: @",
            "lr: {type: float, low: @, high: 10.0}",
            "lr: {type: float, low: 0.1, high: 10.0, step: @}",
            "batch_size: {type: int, low: 32, high: @}",
            "momentum: {type: categorical, choices: [@, 0.9]}",
            "momentum: {type: @, choices: [0.5, 0.9]}",
            "use_wd: {type: categorical, choices: [true, false]}\n"
            "  weight_decay: {type: float, low: 0.1, high: 1.0, when: {use_wd: @}}",
            "@: 1.0",
        )
    ),
    (load_search_space, "optimizer: @\nparams: {lr: 1.0}\n"),
    *(
        (load_pipeline, "".join(f"{k}: {'@' if k == key else v}\n" for k, v in PIPELINE.items()))
        for key in PIPELINE
    ),
    (load_pipeline, "".join(f"{k}: {v}\n" for k, v in PIPELINE.items()) + "train: {lr: @}\n"),
    *((load_configs, f"{key}\n") for key in ("lr: @", "epochs: @", "optimizer: @", "- {delta: @}")),
)


@fuzz(250)
@given(slot=st.sampled_from(QUIRK_SLOTS), quirk=st.sampled_from(QUIRKS))
def test_a_quirk_in_a_valid_file_loads_or_fails_in_one_line(workdir, slot, quirk):
    load, template = slot
    load_or_one_line_error(load, workdir / "quirk.yaml", template.replace("@", quirk).encode())


# -- command lines ------------------------------------------------------------------------------

# URIs MLflow cannot use: schemes it lacks, no server there, its retired file store
BAD_TRACKING_URIS = ("http://127.0.0.1:1", "http://localhost:99999", "https://[::1")
BAD_TRACKING_URIS += MLFLOW_ERROR_URIS
BAD_DEVICES = ("tpu", "gpu", "cuda:x", "CPU", "cuda:-1", " cpu", "cuda:0:1", "", "mps:0")
SYNTHETIC_TRAIN_IMAGES = 1800  # the default 2,000 synthetic images less a tenth held out


def _bad_train_flags() -> st.SearchStrategy[list[str]]:
    def flag(name: str, values: st.SearchStrategy) -> st.SearchStrategy[list[str]]:
        return values.map(lambda v: [f"--{name}={v}"])

    return st.one_of(
        flag("epsilon", st.one_of(st.floats(max_value=0), st.just(float("nan")))),
        flag("delta", st.one_of(st.floats(min_value=1), st.floats(max_value=0))),
        flag("batch-size", st.integers(SYNTHETIC_TRAIN_IMAGES + 1, 10**12)),
        flag("seed", st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32))),
        flag("epochs", st.integers(max_value=0)),
        flag("lr", st.floats(max_value=0)),
        flag("device", st.sampled_from(BAD_DEVICES)),
        flag("tracking-uri", st.sampled_from(BAD_TRACKING_URIS)),
        flag("optimizer", st.sampled_from(("dp-sgdd", "DP-SGD", "", "adamw"))),
        flag("model", st.sampled_from(("resnet", "", "small_cnn"))),
        st.sampled_from(("nowhere", "", ".")).map(
            lambda p: ["--dataset=cifar10", f"--data-path=/nonexistent/{p}"]
        ),
    )


def _run_count(store: Path) -> int:
    if not store.exists():
        return 0
    with contextlib.closing(sqlite3.connect(store)) as db:
        if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'runs'").fetchone():
            return 0
        return db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]


STORES = itertools.count()


def assert_rejected(workdir: Path, args: list[str], store: Path | None = None) -> None:
    """``dpivon ARGS`` exits non-zero with one line, no traceback, and no MLflow run in
    ``store`` (a fresh one unless given), the default ``$MLFLOW_TRACKING_URI``."""
    store = store or workdir / f"store-{next(STORES)}.db"
    with contextlib.chdir(workdir):
        result = CliRunner().invoke(
            app, args, env={"MLFLOW_TRACKING_URI": f"sqlite:///{store}", "DPIVON_DATA": None}
        )
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert _run_count(store) == 0 and _run_count(workdir / "mlflow.db") == 0


@fuzz(150)
@given(bad=_bad_train_flags())
def test_train_rejects_bad_flags_before_training(workdir, bad):
    store = workdir / f"store-{next(STORES)}.db"
    base = ["train", "--dataset=synthetic", "--optimizer=dp-sgd", "--epochs=1"]
    args = [*base, f"--tracking-uri=sqlite:///{store}", *bad]  # the last --tracking-uri counts
    assert_rejected(workdir, args, store)


# Changes that make the pipeline above invalid
BAD_PIPELINE_CHANGES = st.one_of(
    st.tuples(st.just("epsilons"), st.floats(max_value=0).map(repr)),
    st.tuples(st.just("delta"), st.floats(min_value=1).map(repr)),
    st.tuples(st.just("trials"), st.integers(max_value=0).map(str)),
    st.tuples(st.just("seed"), st.integers(max_value=-1).map(str)),
    st.tuples(
        st.just("data"),  # fewer training images than the space's largest batch
        st.integers(10, 200).map(lambda n: f"{{dataset: synthetic, synthetic_size: {n}}}"),
    ),
    st.tuples(st.just("optimizers"), st.just("[{name: dp-sgd, space: nowhere.yaml}]")),
    st.tuples(st.sampled_from(("trails", "epsilon", "Name")), SCALAR),
)


@fuzz(60)
@given(
    case=st.one_of(
        BAD_PIPELINE_CHANGES.map(lambda change: (dict([change]), None)),
        st.sampled_from(BAD_TRACKING_URIS).map(lambda uri: ({}, uri)),  # a valid pipeline
    )
)
def test_sweep_rejects_a_bad_pipeline_or_tracking_uri_before_training(workdir, case):
    changes, uri = case
    path = workdir / "sweep.yaml"
    path.write_bytes("".join(f"{k}: {v}\n" for k, v in {**PIPELINE, **changes}.items()).encode())
    args = ["sweep", str(path), *([f"--tracking-uri={uri}"] if uri else [])]
    assert_rejected(workdir, args)


@fuzz(60)
@given(
    sweep=st.one_of(
        st.text(alphabet="abc-_./", min_size=1, max_size=8).filter(lambda s: s[0] != "-"),
        st.just(str(ROOT / "pipelines")),
    ),
    bad=st.sampled_from(([], ["--pick=best"], ["--epochs=0"], ["--epsilon=nan"], ["--pick="])),
)
def test_export_rejects_a_missing_sweep(workdir, sweep, bad):
    assert_rejected(workdir, ["export", sweep, f"--out={workdir / 'out.yaml'}", *bad])


# -- what the fuzzers found, kept as regressions: each a minimal input ----------------------------


def test_found_a_character_yaml_forbids_is_a_one_line_error(tmp_path):
    path = tmp_path / "nul.yaml"
    path.write_bytes(b"\x00")
    with pytest.raises(DpivonError) as info:
        load_configs(path)
    assert_one_line(info.value, path)


@pytest.mark.parametrize("value", ["._", "!!float x", "9" * 5000, "[" * 600 + "]" * 600])
def test_found_a_value_yaml_cannot_build_is_a_one_line_error(tmp_path, value):
    path = tmp_path / "config.yaml"
    path.write_text(f"lr: {value}\n")
    with pytest.raises(DpivonError) as info:
        load_configs(path)
    assert_one_line(info.value, path)


def test_found_an_int_beyond_floats_is_a_one_line_error():
    with pytest.raises(DpivonError):
        parse_config({"epochs": 10**400})


@pytest.mark.parametrize("data", [{"privacy": None, "epsilon": 1.0}, {"optimizer": []}])
def test_found_a_config_of_the_wrong_shape_is_a_one_line_error(data):
    with pytest.raises(DpivonError):
        parse_config(data)


def test_found_yes_is_no_mc_samples():
    with pytest.raises(DpivonError):
        parse_config({"optimizer": "dp-sgd", "mc_samples": True})


def test_found_an_unusable_tracking_uri_is_a_one_line_error(workdir):
    assert_rejected(workdir, ["train", "--dataset=synthetic", "--tracking-uri=foo://bar"])


def test_found_a_batch_larger_than_the_data_is_rejected_before_the_run(workdir):
    assert_rejected(workdir, ["train", "--dataset=synthetic", "--batch-size=1801"])


def test_found_a_flag_value_of_the_wrong_type_is_a_one_line_error(workdir):
    assert_rejected(workdir, ["train", "--epochs=x"])


# -- structure-aware mutations of every shipped file -----------------------------------------

SHIPPED_SPACES = sorted((ROOT / "search_spaces").rglob("*.yaml"))
SHIPPED_PIPELINES = shipped_run_files(benchmarks=False)
SHIPPED_BENCHMARKS = shipped_run_files(benchmarks=True)
SHIPPED = (
    *((load_search_space, p) for p in SHIPPED_SPACES),
    *((load_pipeline, p) for p in SHIPPED_PIPELINES),
    *((load_benchmark, p) for p in SHIPPED_BENCHMARKS),
)
# Values a mutation puts anywhere in a file's tree
ODD_VALUES = st.one_of(
    st.sampled_from((None, True, False, 0, -1, 1, 2**63, 10**6, 1e-12, 1e308, -0.5)),
    st.sampled_from((math.inf, math.nan, "", "x y", "a/b", "-x", "../..", "null", [], {})),
    st.sampled_from(([1, 2], {"type": "float"}, {"when": {}}, [None], "1e-6", "dp-sgd")),
)
DUPLICATE = "@DUPLICATE@"  # a key written twice in the same mapping (see _emit)


def _shipped_tree(path: Path) -> Any:
    """The file's tree, with a pipeline's space paths and a benchmark's sweep folders made
    absolute (it is loaded from another folder; sweep folders are run from the repo root)."""
    tree = yaml.safe_load(path.read_text())
    for entry in tree.get("optimizers", []) if isinstance(tree, dict) else []:
        entry["space"] = str((path.parent / entry["space"]).resolve())
    for method in tree.get("methods", []) if isinstance(tree, dict) else []:
        if "from_sweep" in method:
            method["from_sweep"] = str(ROOT / method["from_sweep"])
    return tree


def _locations(tree: Any, at: tuple = ()) -> list[tuple]:
    """Every place in the tree: the keys and indices leading to each node."""
    places = [at]
    children = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(
        tree, list) else ()  # fmt: skip
    for key, child in children:
        places += _locations(child, (*at, key))
    return places


def _parent(tree: Any, place: tuple) -> Any:
    for key in place[:-1]:
        tree = tree[key]
    return tree


@st.composite
def mutated_shipped_file(draw: st.DrawFn) -> tuple[Callable, str, str]:
    """(loader, kind of the last mutation, YAML text): a shipped file with one to three
    changes, each dropping, replacing, renaming or duplicating one node of its tree."""
    load, path = draw(st.sampled_from(SHIPPED))
    tree = _shipped_tree(path)
    kind = ""
    for _ in range(draw(st.sampled_from((1, 1, 2, 3)))):
        places = [p for p in _locations(tree) if p]
        if not places:  # everything dropped already
            break
        place = draw(st.sampled_from(places))
        parent, key = _parent(tree, place), place[-1]
        kind = draw(st.sampled_from(("drop", "set", "set", "rename", "duplicate")))
        if kind == "drop":
            del parent[key]
        elif kind == "set":
            parent[key] = copy.deepcopy(draw(ODD_VALUES))  # shared by every example
        elif isinstance(parent, dict) and kind == "rename":
            parent[f"{key}s"] = parent.pop(key)  # a near miss: epsilon -> epsilons
        elif isinstance(parent, dict) and isinstance(key, str):  # duplicate
            twin = draw(st.one_of(st.just(parent[key]), ODD_VALUES))
            parent[f"{key}{DUPLICATE}"] = copy.deepcopy(twin)
        else:
            kind = "drop"
            del parent[key]
    return load, kind, _emit(tree)


def _emit(tree: Any) -> str:
    text = yaml.safe_dump(tree, sort_keys=False, default_flow_style=False, width=10**6)
    return text.replace(DUPLICATE, "")


@fuzz(250)
@given(case=mutated_shipped_file())
def test_a_mutated_shipped_file_loads_or_fails_in_one_line(workdir, case):
    load, kind, text = case
    loaded = load_or_one_line_error(load, workdir / "mutated.yaml", text.encode())
    # silent acceptances: a key given twice, or a near-miss name of a key
    assert loaded is None or kind not in ("duplicate", "rename"), f"accepted a {kind}d key:\n{text}"


# Changes that no loader may accept, each with the words its refusal must use
MUST_REFUSE = {
    "epsilon below every reachable one": ("epsilons", [1e-12], "smallest"),
    "epsilon 1e308": ("epsilons", [1e308], "above 1000"),
    "trials unbounded": ("trials", 10**7, "trials must be in"),
    "concurrency unbounded": ("concurrency", 10**7, "concurrency must be in"),
    "name with a slash": ("name", "a/b", "name"),
}


@fuzz(100)
@given(
    load_path=st.sampled_from([(load_pipeline, p) for p in SHIPPED_PIPELINES]
                              + [(load_benchmark, p) for p in SHIPPED_BENCHMARKS]),
    change=st.sampled_from(sorted(MUST_REFUSE)),
    also=st.lists(st.sampled_from(("experiment", "epochs", "delta")), unique=True, max_size=2),
)  # fmt: skip
def test_a_shipped_run_file_refuses_each_invalid_change(workdir, load_path, change, also):
    load, source = load_path
    key, value, words = MUST_REFUSE[change]
    tree = _shipped_tree(source)
    methods = tree.get("methods", [])
    fixed_noise = any("fixed_noise_multiplier" in m.get("train", {}) for m in methods)
    # fixed noise calibrates nothing: its epsilon is a cap the accountant checks, any size
    assume(not (change == "epsilon 1e308" and fixed_noise))
    if change == "epsilon below every reachable one" and fixed_noise:
        words = "above the budget epsilon 1e-12"  # the cap is checked against what runs
    if key == "trials" and load is load_benchmark:
        key, words = "concurrency", "concurrency must be in"  # a benchmark has no trials
    tree[key] = value
    for other in also:  # harmless changes alongside
        harmless = {"experiment": "fuzz", "epochs": tree.get("epochs", 10) * 2, "delta": 1e-6}
        tree[other] = harmless[other]
    path = workdir / "must-refuse.yaml"
    path.write_text(_emit(tree))
    with pytest.raises(DpivonError) as info:
        load(path)
    assert_one_line(info.value, path)
    assert words in str(info.value), str(info.value)


# -- command lines from each command's own options -----------------------------------------

COMMANDS = {name: command for name, command in typer.main.get_command(app).commands.items()}


def _value_pool(workdir: Path) -> list[str]:
    fifo = workdir / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    regular = workdir / "regular.txt"
    regular.write_text("lr: 0.1\n")
    return [
        *("0", "-1", "1", "2", "8", "0.5", "1e-12", "1e308", "nan", "inf", "-inf", "99999999999"),
        *("dp-sgd", "dp-adam", "dp-ivon-gradsq", "synthetic", "cifar10", "small-cnn", "cpu"),
        *("cuda", "cuda:9", "mps", "rdp", "prv", "knee", "pareto", "", "x y", "a/b", "-"),
        *("lr=null", "lr=0.5", "optimizer.lr=2", "epochs=null", "x=1", "lr", "="),
        *(str(workdir), str(regular), f"{regular}/under", "/dev/null", str(fifo), "nowhere"),
        *(str(p) for p in (*SHIPPED_PIPELINES, *SHIPPED_BENCHMARKS, *SHIPPED_SPACES[:2])),
        "sqlite://",
        "foo://bar",
        "http://127.0.0.1:1",
    ]


@st.composite
def command_line(draw: st.DrawFn, pool: list[str]) -> list[str]:
    """A command and some of its own options and arguments, with values from ``pool``."""
    name = draw(st.sampled_from(sorted(COMMANDS)))
    args = [name]
    params = COMMANDS[name].params
    for param in params:
        if param.param_type_name == "argument":
            args.append(draw(st.sampled_from(pool)))
    chosen = draw(st.lists(st.sampled_from([p for p in params if p.opts[0].startswith("--")]),
                           max_size=4))  # fmt: skip
    for param in chosen:
        if param.is_flag:
            args.append(draw(st.sampled_from([*param.opts, *param.secondary_opts])))
        else:
            args.append(f"{param.opts[0]}={draw(st.sampled_from(pool))}")
    return args


class _Reached(Exception):
    """A command got past every check to where it would train, run or write."""


# Where each command would start work: reaching one of these means it accepted the input
WORK_STARTS = ("dpivon.runs.load_data", "dpivon.tracking.client.Tracker",
               "dpivon.search.sweep.run_sweep", "dpivon.study.benchmark.run_benchmark")  # fmt: skip


@fuzz(160)
@given(data=st.data())
def test_a_command_line_is_refused_in_one_line_or_reaches_its_work(workdir, data):
    args = data.draw(command_line(_value_pool(workdir)))
    store = workdir / f"store-{next(STORES)}.db"
    reached = []

    def start(*_args, **_kwargs):
        reached.append(True)
        raise typer.Exit(0)

    with pytest.MonkeyPatch.context() as patch, contextlib.chdir(workdir):
        for target in WORK_STARTS:
            patch.setattr(target, start)
        result = CliRunner().invoke(
            app, args, env={"MLFLOW_TRACKING_URI": f"sqlite:///{store}", "DPIVON_DATA": None}
        )
    if reached:
        return
    assert result.exit_code != 0, (args, result.output)
    assert isinstance(result.exception, SystemExit), (args, repr(result.exception))
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, (args, result.output)
    assert not store.exists() and _run_count(workdir / "mlflow.db") == 0, args
