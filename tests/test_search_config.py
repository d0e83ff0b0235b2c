"""Search spaces and pipelines: the shipped files, sampling, conditionals, every bad input."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from sweep_helpers import shipped_run_files, write_pipeline

from dpivon.config import FLAT_KEYS, parse_config
from dpivon.errors import DpivonError
from dpivon.privacy.tuning import draw_trial_count
from dpivon.search.pipeline import Pipeline, load_pipeline
from dpivon.search.space import SearchSpace, load_search_space

ROOT = Path(__file__).resolve().parents[1]
SPACE_FILES = sorted((ROOT / "search_spaces").rglob("*.yaml"))
# Sweep pipelines, and `dpivon benchmark` files (they list methods; their own test below).
PIPELINE_FILES = shipped_run_files(benchmarks=False)
BENCHMARK_FILES = shipped_run_files(benchmarks=True)

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def _study(seed: int = 0) -> optuna.Study:
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))


def _assert_inside(space: SearchSpace, params: dict[str, Any]) -> None:
    for name, value in params.items():
        param = space.distributions[name]
        if isinstance(param, FloatDistribution):
            assert isinstance(value, float)
            assert param.low <= value <= param.high, (name, value)
        elif isinstance(param, IntDistribution):
            assert isinstance(value, int)
            assert param.low <= value <= param.high, (name, value)
        else:
            assert isinstance(param, CategoricalDistribution)
            assert value in param.choices, (name, value)


def _sample(space: SearchSpace, n: int, seed: int = 0) -> list[tuple[dict, dict]]:
    """(fixed values returned, trial.params) for n asks of a seeded random-sampler study."""
    study = _study(seed)
    out = []
    for _ in range(n):
        trial = study.ask()
        fixed = space.define_by_run(trial)
        out.append((fixed, dict(trial.params)))
        study.tell(trial, 0.0)
    return out


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def one_line_refusal(load: Callable[[Path], object], path: Path) -> str:
    """The message with which ``load`` refuses ``path``: one line that names the file."""
    with pytest.raises(DpivonError) as info:
        load(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    return message


# -- the shipped files -------------------------------------------------------------------------


def test_shipped_files_are_there():
    names = set(_ids(SPACE_FILES)) | set(_ids(PIPELINE_FILES))
    for name in (
        "search_spaces/dp-ivon-gradsq.yaml",
        "search_spaces/dp-ivon-gradsq-uncorrected.yaml",
        "search_spaces/dp-sgd.yaml",
        "search_spaces/dp-adam.yaml",
        "search_spaces/quickstart/dp-ivon-gradsq.yaml",
        "search_spaces/quickstart/dp-sgd.yaml",
        "search_spaces/quickstart/dp-adam.yaml",
        "pipelines/quickstart.yaml",
        "pipelines/cifar10-eps-grid.yaml",
        "pipelines/cluster-example.yaml",
        "pipelines/smoke.yaml",
    ):
        assert name in names


@pytest.mark.parametrize("path", SPACE_FILES, ids=_ids(SPACE_FILES))
def test_shipped_space_loads_and_samples_inside_bounds(path):
    space = load_search_space(path)
    assert space.path == path
    assert path.stem.startswith(space.optimizer)
    assert path.read_text().startswith("#")  # the documented format header
    json.dumps(space.to_dict())
    assert space.to_dict()["optimizer"] == space.optimizer
    for fixed, params in _sample(space, 12):
        assert fixed == space.fixed
        _assert_inside(space, params)
        config = space.trial_config(params)
        assert config["optimizer"] == space.optimizer
        parse_config(config, source=str(path))


def test_full_size_spaces_follow_the_lessons():
    ivon = load_search_space(ROOT / "search_spaces/dp-ivon-gradsq.yaml")
    lr = ivon.distributions["lr"]
    assert isinstance(lr, FloatDistribution) and lr.log and lr.low > 0.2 and lr.high >= 10
    beta2 = ivon.distributions["beta2"]
    assert isinstance(beta2, CategoricalDistribution)
    assert {0.99, 0.999, 0.9999, 0.99999} <= set(beta2.choices)
    uncorrected = load_search_space(ROOT / "search_spaces/dp-ivon-gradsq-uncorrected.yaml")
    assert uncorrected.to_dict()["params"] == ivon.to_dict()["params"]
    for name in ("dp-ivon-gradsq", "dp-sgd", "dp-adam"):
        full = load_search_space(ROOT / f"search_spaces/{name}.yaml")
        small = load_search_space(ROOT / f"search_spaces/quickstart/{name}.yaml")
        assert 1000 < full.max_value("batch_size") <= 45_000
        assert small.max_value("batch_size") <= 256


@pytest.mark.parametrize("path", PIPELINE_FILES, ids=_ids(PIPELINE_FILES))
def test_shipped_pipeline_loads_and_every_trial_is_a_train_config(path):
    pipeline = load_pipeline(path)
    assert pipeline.path == path
    assert pipeline.source_text == path.read_text()
    assert list(pipeline.spaces) == pipeline.optimizer_names
    counts = pipeline.trial_counts()
    assert set(counts) == {(o, e) for o in pipeline.optimizer_names for e in pipeline.epsilon_list}
    assert all(k >= 1 for k in counts.values())
    for name, space in pipeline.spaces.items():
        assert space.optimizer == name
        for eps in pipeline.epsilon_list:
            base = pipeline.base_train_config(name, eps)
            for _, params in _sample(space, 5):
                config = parse_config({**base, **space.trial_config(params)})
                # a noise-faithful trial spends its own epsilon, what its fixed noise costs
                spent = base["epsilon"] if pipeline.noise_faithful else eps
                assert config.optimizer.name == name and config.privacy.epsilon == spent
                assert config.model == pipeline.model
                assert config.training.epochs == pipeline.trial_epochs
                assert config.training.batch_size <= pipeline.data.train_size


def test_shipped_pipelines_say_what_they_promise():
    quick = load_pipeline(ROOT / "pipelines/quickstart.yaml")
    assert quick.data.train_size == 4000 and quick.data.val_size == 1000
    assert quick.model.name == "small-cnn" and quick.epochs == 4 and quick.epsilon_list == [8.0]
    assert quick.optimizer_names == ["dp-ivon-gradsq", "dp-sgd", "dp-adam"]
    assert quick.trials == 4 and quick.concurrency == 2 and quick.resources.cpu == 1
    assert quick.scheduler.type == "asha" and quick.train == {"bma_samples": 8}
    grid = load_pipeline(ROOT / "pipelines/cifar10-eps-grid.yaml")
    assert grid.data.train_size == 45_000 and grid.model.name == "tanh-cnn" and grid.epochs == 30
    assert grid.epsilon_list == [1.0, 2.0, 4.0, 8.0]
    assert grid.resources.gpu == 0.5 and grid.concurrency == 8
    cluster = load_pipeline(ROOT / "pipelines/cluster-example.yaml")
    assert "ray://head:10001" in cluster.source_text and "RayJob" in cluster.source_text
    assert "postgresql+psycopg2://" in cluster.source_text
    assert cluster.optimizer_names == grid.optimizer_names
    smoke = load_pipeline(ROOT / "pipelines/smoke.yaml")
    assert smoke.data.dataset == "synthetic" and smoke.epochs == 2
    assert len(smoke.optimizers) == 2 and smoke.trials == 2
    names = [load_pipeline(p).name for p in PIPELINE_FILES]
    assert len(set(names)) == len(names)  # the resume keys differ


def test_define_by_run_works_with_rays_optuna_search(tmp_path):
    from ray.tune.search.optuna import OptunaSearch

    space = load_search_space(
        _write(
            tmp_path / "s.yaml",
            "optimizer: dp-sgd\nparams:\n"
            "  lr: {type: float, low: 0.05, high: 10.0, log: true}\n"
            "  use_wd: {type: categorical, choices: [true, false]}\n"
            "  weight_decay: {type: float, low: 1.0e-6, high: 1.0e-2, log: true, "
            "when: {use_wd: true}}\n"
            "  momentum: 0.5\n",
        )
    )
    search = OptunaSearch(
        space=space.define_by_run,
        metric=["val_accuracy", "val_ece"],
        mode=["max", "min"],
        seed=0,
    )
    seen = set()
    for i in range(12):
        config = search.suggest(f"t{i}")
        assert config["momentum"] == 0.5 and "lr" in config
        trial = space.trial_config(config)
        assert "use_wd" not in trial and trial["momentum"] == 0.5
        assert ("weight_decay" in trial) == config["use_wd"]
        seen.add(config["use_wd"])
        parse_config(trial)
    assert seen == {True, False}


# -- the space format --------------------------------------------------------------------------

CONDITIONAL = """\
optimizer: dp-ivon-gradsq
params:
  lr: {type: float, low: 0.5, high: 50.0, log: true}
  use_wd: {type: categorical, choices: [true, false]}
  weight_decay: {type: float, low: 1e-6, high: 1e-2, log: true, when: {use_wd: true}}
  family: {type: categorical, choices: [a, b, c]}
  hess_init: {type: float, low: 0.01, high: 2.0, when: {family: [a, b], use_wd: true}}
  batch_size: {type: int, low: 32, high: 256, step: 32}
  ess: {type: categorical, choices: [100, 1000], when: {batch_size: [32, 64]}}
  mc_samples: 1
  lr_schedule: cosine
"""


NESTEROV_AND_DAMPENING = """\
optimizer: dp-sgd
params:
  momentum: {type: categorical, choices: [0.0, 0.9]}
  nesterov: {type: categorical, choices: [false, true], when: {momentum: 0.9}}
  dampening: {type: categorical, choices: [0.0, 0.5]%s}
"""


def test_bounds_are_checked_in_the_combinations_a_trial_can_draw(tmp_path):
    """SGD refuses Nesterov with dampening: a space that can draw both together is refused,
    one whose conditions keep them apart loads (its high corner would pair them were the
    conditions ignored)."""
    both = _write(tmp_path / "both.yaml", NESTEROV_AND_DAMPENING % "")
    assert "nesterov needs dampening 0" in one_line_refusal(load_search_space, both)
    apart = _write(
        tmp_path / "apart.yaml",
        NESTEROV_AND_DAMPENING % ", when: {momentum: 0.9, nesterov: false}",
    )
    space = load_search_space(apart)
    assert space.conditions["dampening"] == {"momentum": [0.9], "nesterov": [False]}


def test_conditional_params_are_active_only_when_their_condition_holds(tmp_path):
    space = load_search_space(_write(tmp_path / "cond.yaml", CONDITIONAL))
    assert space.switches == {"use_wd", "family"}
    assert space.fixed == {"mc_samples": 1, "lr_schedule": "cosine"}
    branches = set()
    for fixed, params in _sample(space, 80, seed=3):
        assert fixed == {"mc_samples": 1, "lr_schedule": "cosine"}
        _assert_inside(space, params)
        assert ("weight_decay" in params) == params["use_wd"]
        assert ("hess_init" in params) == (params["use_wd"] and params["family"] in "ab")
        assert ("ess" in params) == (params["batch_size"] in (32, 64))
        assert params["batch_size"] % 32 == 0
        branches.add((params["use_wd"], "hess_init" in params, "ess" in params))
        config = space.trial_config(params)
        assert "use_wd" not in config and "family" not in config
        assert config["mc_samples"] == 1 and config["lr_schedule"] == "cosine"
        assert ("weight_decay" in config) == params["use_wd"]
        parse_config(config)
    assert {b[0] for b in branches} == {True, False}
    assert {b[1] for b in branches} == {True, False}
    assert {b[2] for b in branches} == {True, False}


def test_trial_config_checks_its_input(tmp_path):
    space = load_search_space(_write(tmp_path / "cond.yaml", CONDITIONAL))
    good = {"lr": 1.0, "use_wd": False, "family": "c", "batch_size": 128}
    assert space.trial_config(good) == {
        "optimizer": "dp-ivon-gradsq",
        "lr": 1.0,
        "batch_size": 128,
        "mc_samples": 1,
        "lr_schedule": "cosine",
    }
    # inactive values are ignored; fixed values (as Ray's config holds them) are fine
    assert space.trial_config({**good, "weight_decay": 0.1, "mc_samples": 1}) == (
        space.trial_config(good)
    )
    with pytest.raises(DpivonError, match=r"'momentum'.*not parameters"):
        space.trial_config({**good, "momentum": 0.9})
    with pytest.raises(DpivonError, match="lack 'weight_decay'"):
        space.trial_config({**good, "use_wd": True})


def test_yaml_numbers_are_numbers(tmp_path):
    space = load_search_space(
        _write(
            tmp_path / "s.yaml",
            "optimizer: dp-adam\nparams:\n"
            "  lr: {type: float, low: 1e-4, high: 3e-2, log: true}\n"
            "  weight_decay: {type: categorical, choices: [0, 1e-5, 1.0e-4]}\n"
            "  max_grad_norm: 1e0\n"
            "  clip_radius: inf\n",
        )
    )
    lr = space.distributions["lr"]
    assert isinstance(lr, FloatDistribution) and (lr.low, lr.high) == (1e-4, 3e-2)
    assert space.distributions["weight_decay"].choices == (0, 1e-5, 1e-4)
    assert space.fixed == {"max_grad_norm": 1.0, "clip_radius": math.inf}
    data = space.to_dict()
    assert yaml.safe_load(yaml.safe_dump(data)) == data


def test_a_parameter_may_be_named_by_its_config_path(tmp_path):
    space = load_search_space(
        _write(
            tmp_path / "s.yaml",
            "optimizer: dp-sgd\nparams:\n"
            "  optimizer.lr: {type: float, low: 0.05, high: 10.0, log: true}\n"
            "  training.batch_size: 64\n",
        )
    )
    assert space.names == ["lr", "batch_size"] and space.max_value("batch_size") == 64
    (_, params), *_ = _sample(space, 1)
    config = parse_config(space.trial_config(params))
    assert config.optimizer.lr == params["optimizer.lr"] and config.training.batch_size == 64


BAD_SPACES = {
    "unknown-top-key": ("optimizer: dp-sgd\nparam: {}\n", "param: unknown key"),
    "no-params": ("optimizer: dp-sgd\n", "params: required"),
    "empty-params": ("optimizer: dp-sgd\nparams: {}\n", "params"),
    "unknown-optimizer": ("optimizer: dp-sgdd\nparams: {lr: 1.0}\n", "unknown; choose one"),
    "unknown-type": ("params: {lr: {type: floot, low: 1, high: 2}}", "'floot'"),
    "mapping-without-type": (
        "params: {lr: {low: 1, high: 2}}",
        "params.lr: a mapping needs a type",
    ),
    "unknown-param-key": (
        "params: {lr: {type: float, low: 1, high: 2, lg: true}}",
        "params.lr: lg: unknown key",
    ),
    "low-not-below-high": (
        "params: {lr: {type: float, low: 2, high: 1}}",
        "params.lr: low must be below high",
    ),
    "low-equals-high": ("params: {batch_size: {type: int, low: 64, high: 64}}", "below high"),
    "log-needs-positive-low": (
        "params: {weight_decay: {type: float, low: 0, high: 1, log: true}}",
        "`low > 0` must hold for `log=True`",
    ),
    "step-and-log": (
        "params: {lr: {type: float, low: 1, high: 2, log: true, step: 0.5}}",
        "`step` is not supported when `log` is true",
    ),
    "step-not-dividing": (
        "params: {batch_size: {type: int, low: 32, high: 100, step: 32}}",
        "multiple of step",
    ),
    "int-bound-float": (
        "params: {batch_size: {type: int, low: 32.5, high: 256}}",
        "params.batch_size: low: must be a whole number",
    ),
    "int-bound-string": (
        "params: {batch_size: {type: int, low: many, high: 256}}",
        "must be a whole number",
    ),
    "float-bound-bool": ("params: {lr: {type: float, low: true, high: 2}}", "takes no boolean"),
    "int-log-step": (
        "params: {batch_size: {type: int, low: 32, high: 256, log: true, step: 32}}",
        "only accept step is 1 when `log` argument is True",
    ),
    "empty-choices": ("params: {momentum: {type: categorical, choices: []}}", "at least 1 item"),
    "duplicate-choices": (
        "params: {momentum: {type: categorical, choices: [0.5, 0.5]}}",
        "distinct",
    ),
    "non-scalar-choice": (
        "params: {momentum: {type: categorical, choices: [[1, 2]]}}",
        "choices.0: must be a number, string, boolean or null",
    ),
    "when-unknown": (
        "params: {lr: {type: float, low: 1, high: 2, when: {nope: 1}}}",
        "when.nope: 'nope' is not a parameter of this space",
    ),
    "when-later": (
        "params:\n  lr: {type: float, low: 1, high: 2, when: {use: true}}\n"
        "  use: {type: categorical, choices: [true, false]}\n",
        "when.use: 'use' is declared later",
    ),
    "when-self": (
        "params: {momentum: {type: categorical, choices: [0, 1], when: {momentum: 0}}}",
        "depend on itself",
    ),
    "when-float": (
        "params:\n  lr: {type: float, low: 1, high: 2}\n"
        "  momentum: {type: categorical, choices: [0.0, 0.9], when: {lr: 1.5}}\n",
        "float range",
    ),
    "when-fixed": (
        "params:\n  lr: 1.0\n  momentum: {type: categorical, choices: [0.0, 0.9], when: {lr: 1}}\n",
        "fixed value",
    ),
    "when-value-never-taken": (
        "params:\n  use: {type: categorical, choices: [true, false]}\n"
        "  weight_decay: {type: float, low: 0.1, high: 1, when: {use: yes_please}}\n",
        "never takes 'yes_please'",
    ),
    "not-a-field": (
        "params: {lrr: {type: float, low: 1, high: 2}}",
        "params.lrr: 'lrr' is not a TrainConfig field (did you mean lr?), nor a switch",
    ),
    "switch-not-categorical": (
        "params:\n  use: {type: int, low: 0, high: 1}\n"
        "  weight_decay: {type: float, low: 0.1, high: 1, when: {use: 1}}\n",
        "a switch must be categorical",
    ),
    "switch-unused": (
        "params: {use_wd: {type: categorical, choices: [true, false]}}",
        "params.use_wd: 'use_wd' is not a TrainConfig field",
    ),
    "bound-invalid-for-trainconfig": (
        "optimizer: dp-adam\nparams: {beta2: {type: categorical, choices: [0.9, 1.5]}}",
        "params.beta2 = 1.5 is not a valid dp-adam setting: beta2 must be in [0, 1)",
    ),
    "low-invalid-for-trainconfig": (
        "params: {lr: {type: float, low: 0, high: 1}}",
        "params.lr = 0.0 is not a valid dp-sgd setting: lr must be in (0, 1e+06]",
    ),
    "fixed-wrong-type": ("params: {batch_size: lots}", "params.batch_size = 'lots'"),
    # a categorical's every choice meets the other parameters' bounds: neither all-low
    # (nesterov false, momentum 0) nor all-high (nesterov true, momentum 0.9) is invalid
    "branch-meets-a-bound": (
        "params:\n  nesterov: {type: categorical, choices: [false, true]}\n"
        "  momentum: {type: float, low: 0.0, high: 0.9}\n",
        "nesterov = True and all parameters at their low values {'momentum': 0.0, "
        "'nesterov': True} is not a valid dp-sgd setting: optimizer: nesterov needs momentum > 0",
    ),
    "branch-meets-a-bound-ivon": (
        "optimizer: dp-ivon-gradsq\nparams:\n"
        "  engine: {type: categorical, choices: [ghost, hooks]}\n"
        "  mc_samples: {type: int, low: 1, high: 2}\n",
        "engine = 'ghost' and all parameters at their high values",
    ),
    "estimator-contradiction": (
        "params: {hess_approx: price}",
        "contradicts",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SPACES), ids=list(BAD_SPACES))
def test_bad_space_is_one_clear_error(tmp_path, case):
    text, expected = BAD_SPACES[case]
    if not text.startswith("optimizer"):
        optimizer = "dp-ivon-gradsq" if case == "estimator-contradiction" else "dp-sgd"
        text = f"optimizer: {optimizer}\n{text}\n"
    message = one_line_refusal(load_search_space, _write(tmp_path / f"{case}.yaml", text))
    assert expected in message, message


@pytest.mark.parametrize(
    ("load", "not_yaml", "not_a_mapping"),
    [
        (load_search_space, "optimizer: dp-sgd\nparams: {lr: [1, \n", "- optimizer: dp-sgd\n"),
        (load_pipeline, "name: x\nepsilons: [8\n", "just text\n"),
    ],
    ids=["space", "pipeline"],
)
def test_file_errors(tmp_path, load, not_yaml, not_a_mapping):
    with pytest.raises(DpivonError, match="file not found"):
        load(tmp_path / "missing.yaml")
    bad = _write(tmp_path / "bad.yaml", not_yaml)
    with pytest.raises(DpivonError, match=r"bad.yaml is not valid YAML \(line"):
        load(bad)
    other = _write(tmp_path / "other.yaml", not_a_mapping)
    with pytest.raises(DpivonError, match="must hold a YAML mapping"):
        load(other)


# -- pipelines ---------------------------------------------------------------------------------

SGD_SPACE = """\
optimizer: dp-sgd
params:
  lr: {type: float, low: 0.05, high: 10.0, log: true}
  batch_size: {type: int, low: 32, high: 128, log: true}
"""
ADAM_SPACE = SGD_SPACE.replace("dp-sgd", "dp-adam")


def _pipeline_dict() -> dict[str, Any]:
    return {
        "name": "t",
        "data": {"dataset": "synthetic", "synthetic_size": 600},
        "model": "small-cnn",
        "epochs": 3,
        "epsilons": [8],
        "delta": 1.0e-5,
        "accountant": "rdp",
        "optimizers": [
            {"name": "dp-sgd", "space": "spaces/dp-sgd.yaml"},
            {"name": "dp-adam", "space": "spaces/dp-adam.yaml"},
        ],
        "trials": 4,
        "trial_count": "fixed",
        "concurrency": 2,
        "resources": {"cpu": 1, "gpu": 0},
        "scheduler": {"type": "asha", "grace_period": 1, "reduction_factor": 2},
        "objectives": [
            {"metric": "val_accuracy", "mode": "max"},
            {"metric": "val_ece", "mode": "min"},
        ],
        "sampler": "tpe",
        "seed": 0,
        "tracking_uri": None,
        "storage_path": "runs",
        "max_failures": 1,
        "train": {"bma_samples": 2},
    }


def _write_pipeline(tmp_path: Path, data: dict[str, Any], name: str = "p.yaml") -> Path:
    _write(tmp_path / "pipes/spaces/dp-sgd.yaml", SGD_SPACE)
    _write(tmp_path / "pipes/spaces/dp-adam.yaml", ADAM_SPACE)
    return _write(tmp_path / "pipes" / name, yaml.safe_dump(data, sort_keys=False))


def test_pipeline_api(tmp_path):
    path = _write_pipeline(tmp_path, _pipeline_dict())
    pipeline = load_pipeline(path)
    assert isinstance(pipeline, Pipeline)
    assert pipeline.path == path and pipeline.source_text == path.read_text()
    assert pipeline.experiment == "dpivon-t"  # the default
    assert list(pipeline.spaces) == ["dp-sgd", "dp-adam"]
    assert pipeline.spaces["dp-sgd"].path == tmp_path / "pipes/spaces/dp-sgd.yaml"
    assert pipeline.epsilon_list == [8.0]
    assert pipeline.objective_pairs == [("val_accuracy", "max"), ("val_ece", "min")]
    assert pipeline.trial_counts() == {("dp-sgd", 8.0): 4, ("dp-adam", 8.0): 4}
    assert pipeline.base_train_config("dp-adam", 8) == {
        "optimizer": "dp-adam",
        "dataset": "synthetic",
        "data_path": None,
        "val_size": 60,  # the data section fills its default: a tenth of synthetic_size
        "per_class": None,
        "synthetic_size": 600,
        "model": "small-cnn",
        "epochs": 3,
        "epsilon": 8.0,
        "delta": 1e-5,
        "accountant": "rdp",
        "research_mode": False,  # secure noise unless the pipeline asks for research mode
        "data_seed": 0,
        "seed": 0,
        "val_noise_multiplier": 0.0,
        "bma_samples": 2,
    }
    assert pipeline.data.train_size == 540
    with pytest.raises(DpivonError, match="no optimizer 'dp-ivon'"):
        pipeline.base_train_config("dp-ivon", 8)
    with pytest.raises(DpivonError, match="no epsilon 3"):
        pipeline.base_train_config("dp-sgd", 3)


def test_pipeline_accepts_yaml_quirks_and_non_private(tmp_path):
    data = _pipeline_dict()
    data["scheduler"] = "none"  # shorthand for {type: none}
    path = _write_pipeline(tmp_path, data)
    text = path.read_text()
    assert "delta: 1.0e-05\n" in text and "epsilons:\n- 8\n" in text
    # PyYAML reads 1e-5 and inf as strings
    text = text.replace("delta: 1.0e-05\n", "delta: 1e-5\n")
    path.write_text(text.replace("epsilons:\n- 8\n", "epsilons: [8, inf]\n"))
    pipeline = load_pipeline(path)
    assert pipeline.delta == 1e-5
    assert pipeline.epsilon_list == [8.0, math.inf]
    assert pipeline.scheduler.type == "none"
    base = pipeline.base_train_config("dp-sgd", math.inf)
    assert parse_config(base).privacy.epsilon == math.inf


def test_a_non_private_optimizer_is_one_group_at_eps_inf(tmp_path):
    """sgd spends no budget: one group labelled inf, never a trial config at epsilon 8."""
    _write(tmp_path / "pipes/spaces/sgd.yaml", "optimizer: sgd\nparams: {lr: 0.1}\n")
    data = _pipeline_dict()
    data["epsilons"] = [1, 8]
    data["optimizers"].append({"name": "sgd", "space": "spaces/sgd.yaml"})
    pipeline = load_pipeline(_write_pipeline(tmp_path, data))
    assert [g for g in pipeline.groups if g[0] == "sgd"] == [("sgd", math.inf)]
    assert set(pipeline.trial_counts()) == set(pipeline.groups)
    assert len(pipeline.groups) == 5  # dp-sgd and dp-adam at 1 and 8, sgd once
    base = pipeline.base_train_config("sgd", 8)
    assert base["epsilon"] == math.inf and parse_config(base).privacy.epsilon == math.inf
    with pytest.raises(DpivonError, match="sgd is not private"):
        parse_config({**base, "epsilon": 8.0})


def test_space_paths_fall_back_to_the_current_directory(tmp_path, monkeypatch):
    _write(tmp_path / "elsewhere/dp-sgd.yaml", SGD_SPACE)
    _write(tmp_path / "elsewhere/dp-adam.yaml", ADAM_SPACE)
    data = _pipeline_dict()
    data["optimizers"] = [
        {"name": "dp-sgd", "space": "elsewhere/dp-sgd.yaml"},
        {"name": "dp-adam", "space": str(tmp_path / "elsewhere/dp-adam.yaml")},
    ]
    path = _write_pipeline(tmp_path, data)
    monkeypatch.chdir(tmp_path)
    pipeline = load_pipeline(path)
    assert pipeline.spaces["dp-sgd"].path == Path("elsewhere/dp-sgd.yaml")


def _set(key: str, value: Any):
    def change(data: dict[str, Any]) -> None:
        target = data
        *parents, last = key.split(".")
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return change


def _drop(key: str):
    return lambda data: data.pop(key)


BAD_PIPELINES = {
    "unknown-key": (_set("trails", 3), "trails: unknown key"),
    "unknown-nested-key": (_set("resources.memory", 4), "resources.memory: unknown key"),
    "missing-name": (_drop("name"), "name: required"),
    "missing-epsilons": (_drop("epsilons"), "give either epsilons"),
    "missing-trials": (_drop("trials"), "trials: required"),
    "bad-name": (_set("name", "Quick Start"), "not a valid sweep name"),
    "epochs-string": (_set("epochs", "three"), "epochs: must be a whole number"),
    "concurrency-float": (_set("concurrency", 1.5), "concurrency: must be a whole number"),
    "trials-bool": (_set("trials", True), "trials takes no boolean"),
    "trials-zero": (_set("trials", 0), "trials must be in [1, 10000]"),
    "concurrency-zero": (_set("concurrency", 0), "concurrency must be in [1, 4096]"),
    "cpu-zero": (_set("resources.cpu", 0), "cpu must be > 0"),
    "gpu-negative": (_set("resources.gpu", -1), "gpu must be >= 0"),
    "gpu-fraction-above-one": (_set("resources.gpu", 1.5), "whole number"),
    "epsilon-zero": (_set("epsilons", [0]), "epsilons must be > 0"),
    "epsilon-negative": (_set("epsilons", -1), "epsilons must be > 0"),
    "epsilon-empty": (_set("epsilons", []), "epsilons: needs at least 1 item"),
    "epsilon-duplicate": (_set("epsilons", [8, 8.0]), "distinct"),
    "delta-zero": (_set("delta", 0), "delta must be in (0, 1)"),
    "delta-one": (_set("delta", 1), "delta must be in (0, 1)"),
    "accountant": (_set("accountant", "gdp"), "accountant: must be one of 'rdp' or 'prv'"),
    "sampler": (_set("sampler", "cmaes"), "sampler: must be one of"),
    "trial-count": (_set("trial_count", "binomial"), "trial_count: must be one of"),
    "asha-one-epoch": (_set("epochs", 1), "asha needs trials of epochs >= 2"),
    "asha-grace": (
        _set("scheduler.grace_period", 3),
        "grace_period (3) must be below the trials' epochs (3)",
    ),
    "asha-reduction": (
        _set("scheduler.reduction_factor", 1),
        "scheduler.reduction_factor: must be >",
    ),
    "scheduler-type": (_set("scheduler", {"type": "hyperband"}), "'hyperband'"),
    "one-objective": (
        _set("objectives", [{"metric": "val_accuracy", "mode": "max"}]),
        "exactly two objectives",
    ),
    "three-objectives": (
        _set(
            "objectives",
            [
                {"metric": "val_accuracy", "mode": "max"},
                {"metric": "val_ece", "mode": "min"},
                {"metric": "val_nll", "mode": "min"},
            ],
        ),
        "exactly two objectives",
    ),
    "same-objective": (
        _set("objectives.1", {"metric": "val_accuracy", "mode": "max"}),
        "must differ",
    ),
    "unknown-metric": (_set("objectives.1.metric", "test_ece"), "objectives.1.metric: must be"),
    "bad-mode": (_set("objectives.1.mode", "minimize"), "objectives.1.mode: must be one of"),
    "wrong-direction": (_set("objectives.0.mode", "min"), "val_accuracy improves by mode max"),
    "unknown-model": (_set("model", "resnet-9000"), "unknown model 'resnet-9000'"),
    "unknown-optimizer": (_set("optimizers.0.name", "dp-sgdd"), "unknown optimizer 'dp-sgdd'"),
    "duplicate-optimizer": (
        _set("optimizers.1", {"name": "dp-sgd", "space": "spaces/dp-sgd.yaml"}),
        "dp-sgd listed more than once",
    ),
    "no-optimizers": (_set("optimizers", []), "optimizers: needs at least 1 item"),
    "space-missing": (_set("optimizers.0.space", "spaces/nope.yaml"), "file not found"),
    "space-other-optimizer": (
        _set("optimizers.0.space", "spaces/dp-adam.yaml"),
        "is a space for dp-adam, not for dp-sgd",
    ),
    "space-invalid": (_set("optimizers.1.space", "bad-space.yaml"), "lrr"),
    "train-owned-key": (_set("train", {"epochs": 3}), "epochs is a pipeline setting"),
    "train-owned-privacy-key": (_set("train", {"val_noise_multiplier": 0.05}), "val_noise"),
    "entry-train-owned-key": (
        _set("optimizers.0.train", {"research_mode": True}),
        "optimizers.0.train: research_mode is a pipeline setting",
    ),
    "delta-above-one-over-n": (_set("delta", 0.01), "delta=0.01 is >= 1/N = 0.00185 for N=540"),
    "best-by-without-best": (_set("best_by", "val_ece"), "best_by applies to release: best"),
    "best-by-no-objective": (
        lambda d: d.update(release="best", best_by="val_nll"),
        "best_by must be one of the objectives",
    ),
    "train-unknown-key": (_set("train", {"bma": 3}), "'bma' is not a TrainConfig field"),
    "train-invalid-value": (_set("train", {"bma_samples": -1}), "bma_samples must be in [0, 1000]"),
    "train-and-space": (_set("train", {"lr": 0.1}), "lr set both under train: and by"),
    "batch-above-data": (
        _set("data", {"dataset": "synthetic", "synthetic_size": 100}),
        "reaches 128",
    ),
    "val-size-too-big": (_set("data.val_size", 600), "val_size (600) must be below the 600"),
    "synthetic-size-for-cifar": (_set("data.dataset", "cifar10"), "synthetic only"),
    "per-class-too-big": (
        _set("data", {"dataset": "cifar10", "per_class": 5000}),
        "per_class 5000 exceeds",
    ),
    "unknown-dataset": (_set("data.dataset", "mnist"), "data.dataset: must be one of"),
    "experiment-empty": (_set("experiment", " "), "experiment must not be empty"),
    "max-failures": (_set("max_failures", -1), "max_failures must be in [0, 100]"),
    "seed-negative": (_set("seed", -1), "seed must be in [0, 2**32)"),
}


@pytest.mark.parametrize(
    ("key", "value"),
    [("val_noise_multiplier", 0.05), ("epsilon", 50.0), ("delta", 0.1), ("research_mode", True),
     ("seed", 7), ("epochs", {"type": "int", "low": 1, "high": 5}), ("data_seed", 3)],
)  # fmt: skip
def test_a_space_may_not_set_what_the_pipeline_owns(tmp_path, key, value):
    """The keys the pipeline sets for every trial (its budget, data, seed) are refused in a
    space at load, in one line: a space sampling val_noise_multiplier would run trials at
    a noise the quote does not use."""
    text = yaml.safe_dump({"optimizer": "dp-sgd", "params": {"lr": 1.0, key: value}})
    _write(tmp_path / "pipes/owning.yaml", text)
    data = _pipeline_dict()
    data["optimizers"][0]["space"] = "owning.yaml"
    path = _write_pipeline(tmp_path, data)
    message = one_line_refusal(load_pipeline, path)
    assert f"params.{key}: {key} is set by the pipeline" in message, message


@pytest.mark.parametrize("case", list(BAD_PIPELINES), ids=list(BAD_PIPELINES))
def test_bad_pipeline_is_one_clear_error(tmp_path, case):
    change, expected = BAD_PIPELINES[case]
    data = _pipeline_dict()
    change(data)
    _write(tmp_path / "pipes/bad-space.yaml", "optimizer: dp-adam\nparams: {lrr: 1.0}\n")
    message = one_line_refusal(load_pipeline, _write_pipeline(tmp_path, data))
    assert expected in message, message


# -- trial counts ------------------------------------------------------------------------------


def test_trial_counts_fixed_and_drawn(tmp_path):
    data = _pipeline_dict()
    data["epsilons"] = [1, 8]
    data["trials"] = 6
    assert set(load_pipeline(_write_pipeline(tmp_path, data)).trial_counts().values()) == {6}
    for kind in ("poisson", "geometric"):
        data["trial_count"] = kind
        pipeline = load_pipeline(_write_pipeline(tmp_path, data))
        # what the tuning accounting is told: K's distribution and its mean
        assert (pipeline.conditions.trial_count, pipeline.conditions.mean_trials) == (kind, 6)
        draws = [pipeline.trial_counts() for _ in range(20)]
        assert all(set(d) == set(pipeline.groups) for d in draws)
        assert all(isinstance(k, int) and k >= 0 for d in draws for k in d.values())
        # From the OS entropy source, not the public pipeline seed: every sweep draws anew.
        assert len({tuple(d.values()) for d in draws}) > 1


@pytest.mark.parametrize("kind", ["poisson", "geometric"])
@pytest.mark.parametrize("mean", [1, 3, 8])
def test_drawn_trial_counts_have_the_right_mean(kind, mean):
    rng = np.random.default_rng(0)
    draws = np.array([draw_trial_count(kind, mean, rng) for _ in range(4000)])
    # Poisson keeps K = 0 (the group then runs nothing): moving it to 1 would change the
    # distribution the random-trials bound assumes.
    assert draws.min() >= (0 if kind == "poisson" else 1)
    if kind == "poisson" and mean == 1:
        assert (draws == 0).mean() == pytest.approx(math.exp(-1), abs=0.03)
    expected = mean
    std = math.sqrt(mean) if kind == "poisson" else math.sqrt(mean * (mean - 1)) + 1e-9
    assert abs(draws.mean() - expected) < 4 * std / math.sqrt(len(draws)) + 1e-9
    if mean == 1 and kind == "geometric":
        assert set(draws) == {1}


def test_fixed_trial_count_and_bad_kind():
    assert draw_trial_count("fixed", 5) == 5
    with pytest.raises(DpivonError, match="unknown trial_count"):
        draw_trial_count("uniform", 5)


def test_the_owned_keys_are_what_builds_a_trial_config(tmp_path):
    """One owner: the keys refused in spaces and `train:` are the base config's own keys."""
    pipeline = load_pipeline(_write_pipeline(tmp_path, _pipeline_dict()))
    owned = pipeline.owned_keys
    assert owned == set(pipeline.owned_settings("dp-sgd", 8.0)) <= set(FLAT_KEYS)
    base = pipeline.base_train_config("dp-sgd", 8)
    assert set(base) - owned == set(pipeline.train)  # the rest are the train extras
    expected = {"val_noise_multiplier", "epsilon", "delta", "research_mode", "seed", "data_seed"}
    assert expected <= owned


@pytest.mark.parametrize("path", BENCHMARK_FILES, ids=lambda p: p.name)
def test_shipped_benchmark_pipelines_load(path):
    from dpivon.study.spec import load_benchmark

    assert load_benchmark(path).name


# A tuning sweep's GPU version and the CPU sweeps it holds (one per epsilon there).
TUNING_GPU_TWINS = {
    "compare-tuning-gpu.yaml": (
        "compare-eps3-tan-tuning.yaml",
        "compare-eps1-tan-tuning.yaml",
        "compare-eps3-tan-tuning-horizon.yaml",
        "compare-eps1-tan-tuning-horizon.yaml",
    ),
    "compare-tuning-gpu-mitigated.yaml": (
        "compare-eps3-tan-tuning-mitigated.yaml",
        "compare-eps1-tan-tuning-mitigated.yaml",
        "compare-eps3-tan-tuning-mitigated-horizon.yaml",
    ),
}


@pytest.mark.parametrize("gpu_file", sorted(TUNING_GPU_TWINS))
def test_a_tuning_sweeps_gpu_version_runs_the_trials_of_its_cpu_sweeps(gpu_file):
    """Every group of the CPU sweeps is in the GPU one, with the same space, trial count and
    trial configs (noise-faithful plan included), tuned by the same sampler and objectives:
    only where the trials run, how many at once and where they are stored may differ."""
    gpu = load_pipeline(ROOT / "pipelines" / gpu_file)
    assert gpu.resources.gpu > 0
    for cpu_file in TUNING_GPU_TWINS[gpu_file]:
        cpu = load_pipeline(ROOT / "pipelines" / cpu_file)
        assert gpu.name != cpu.name and gpu.data == cpu.data
        same = ("epochs", "delta", "accountant", "trials", "trial_count", "scheduler",
                "objectives", "sampler", "seed", "noise_faithful", "validation_noise",
                "release", "research_mode")  # fmt: skip
        assert {k: getattr(gpu, k) for k in same} == {k: getattr(cpu, k) for k in same}
        assert set(cpu.groups) <= set(gpu.groups)
        for optimizer, epsilon in cpu.groups:
            assert gpu.spaces[optimizer].path == cpu.spaces[optimizer].path
            assert gpu.base_train_config(optimizer, epsilon) == cpu.base_train_config(
                optimizer, epsilon
            )


# A study's GPU version (pipelines/ keeps one per study for a cluster) and the study itself.
GPU_TWINS = {
    "compare-eps3-gpu.yaml": "compare-eps3.yaml",
    "compare-eps3-tan-gpu.yaml": "compare-eps3-tan.yaml",
}


@pytest.mark.parametrize("gpu_file", sorted(GPU_TWINS))
def test_a_studys_gpu_version_trains_exactly_its_runs(gpu_file):
    """The two files repeat the method list: only where the runs go and how many at once
    may differ, or the GPU results would answer another question."""
    from dpivon.study.spec import load_benchmark

    gpu = load_benchmark(ROOT / "pipelines" / gpu_file)
    cpu = load_benchmark(ROOT / "pipelines" / GPU_TWINS[gpu_file])
    assert gpu.resources.gpu > 0 and gpu.name != cpu.name  # its own store and resume key
    assert gpu.data == cpu.data
    # and is scored alike: under shift, and averaged over the same weight noise
    assert (gpu.shift, gpu.weight_noise_scales) == (cpu.shift, cpu.weight_noise_scales)
    assert [(r.key, r.config.flat(), r.tuned_by) for r in gpu.runs] == [
        (r.key, r.config.flat(), r.tuned_by) for r in cpu.runs
    ]


# -- start points and the sampler's random phase (issue 27) ------------------------------------

START_SPACE = """\
optimizer: dp-sgd
params:
  lr: {type: float, low: 0.25, high: 4.0, log: true}
  max_grad_norm: {type: float, low: 0.025, high: 0.4, log: true}
  use_nesterov: {type: categorical, choices: [false, true]}
  nesterov: {type: categorical, choices: [true], when: {use_nesterov: true}}
  momentum: 0.9
start:
  - {lr: 1.0, max_grad_norm: 0.1, use_nesterov: false}
  - {lr: 2.0, max_grad_norm: 0.05, use_nesterov: true, nesterov: true}
"""


def test_start_points_run_first_then_tpe_after_a_third_of_the_budget(tmp_path):
    from dpivon.search.groups import group_search, sweep_groups

    _write(tmp_path / "pipes/spaces/dp-sgd.yaml", START_SPACE)
    _write(tmp_path / "pipes/spaces/dp-adam.yaml", ADAM_SPACE)
    data = {**_pipeline_dict(), "trials": 16}
    pipeline = load_pipeline(_write(tmp_path / "pipes/p.yaml", yaml.safe_dump(data)))
    assert pipeline.spaces["dp-sgd"].dimension == 4  # three sampled and one switch
    assert pipeline.spaces["dp-adam"].dimension == 2
    assert pipeline.startup_trials == 5  # a third of 16, not Optuna's 10
    assert pipeline.random_phase_note() is None
    counts = pipeline.trial_counts()
    (group, _) = sweep_groups(pipeline, {"eps8-dp-sgd": 8.0, "eps8-dp-adam": 8.0}, counts)
    search = group_search(pipeline, group)
    assert search._ot_study.sampler._n_startup_trials == 5
    first, second, third = (search.suggest(f"t{i}") for i in range(3))
    assert (first["lr"], first["max_grad_norm"], first["use_nesterov"]) == (1.0, 0.1, False)
    assert "nesterov" not in first
    assert (second["lr"], second["nesterov"]) == (2.0, True)
    assert (third["lr"], third["max_grad_norm"]) != (1.0, 0.1)  # then the sampler draws
    # the start points are tried before any random draw: not the random-trials bound's
    # identical draws
    assert "start points are tried first" in " ".join(pipeline.conditions.random_trials_obstacles())


def test_a_budget_left_in_the_random_phase_says_so(tmp_path):
    _write(tmp_path / "pipes/spaces/dp-sgd.yaml", START_SPACE)
    _write(tmp_path / "pipes/spaces/dp-adam.yaml", ADAM_SPACE)
    for trials, sampler, said in (
        (2, "tpe", True),
        (3, "tpe", False),
        (16, "nsga2", True),
        (4, "random", False),
    ):
        data = {**_pipeline_dict(), "trials": trials, "sampler": sampler}
        pipeline = load_pipeline(_write(tmp_path / "pipes/p.yaml", yaml.safe_dump(data)))
        note = pipeline.random_phase_note()
        assert (note is not None) == said, (trials, sampler, note)
        if (trials, sampler) == (2, "tpe"):  # one random start, then the two start points
            assert "dp-sgd has 2 start point(s)" in note and "\n" not in note


@pytest.mark.parametrize(
    ("start", "message"),
    [
        ("[{lr: 9.0, max_grad_norm: 0.1, use_nesterov: false}]", "start.0.lr: 9.0 is outside"),
        ("[{lr: 1.0, use_nesterov: false}]", "gives no value for the active max_grad_norm"),
        (
            "[{lr: 1.0, max_grad_norm: 0.1, use_nesterov: false, nesterov: true}]",
            "sets nesterov, inactive at this point",
        ),
        (
            "[{lr: 1.0, max_grad_norm: 0.1, use_nesterov: false, momentum: 0.5}]",
            "'momentum' is a fixed value",
        ),
        ("[{lr: 1.0, max_grad_norm: 0.1, use_nesterov: 1}]", "use_nesterov: 1 is outside"),
    ],
)
def test_a_bad_start_point_is_one_clear_error(tmp_path, start, message):
    text = START_SPACE.split("start:")[0] + f"start: {start}\n"
    path = _write(tmp_path / "s.yaml", text)
    line = one_line_refusal(load_search_space, path)
    assert message in line and str(path) in line


# -- noise-faithful tuning (TAN) ----------------------------------------------------------------

NO_BATCH_SPACE = """\
optimizer: dp-sgd
params:
  lr: {type: float, low: 0.05, high: 10.0, log: true}
"""


def _noise_faithful_pipeline(tmp_path: Path, **changes: Any) -> Path:
    _write(tmp_path / "pipes/spaces/dp-sgd.yaml", NO_BATCH_SPACE)
    _write(tmp_path / "pipes/spaces/dp-adam.yaml", NO_BATCH_SPACE.replace("dp-sgd", "dp-adam"))
    data = {**_pipeline_dict(), "train": {"batch_size": 128}}
    data.update({"noise_faithful": {"batch_divisor": 4}, **changes})
    return _write(tmp_path / "pipes/p.yaml", yaml.safe_dump(data))


def test_a_noise_faithful_trial_holds_the_targets_steps_and_noise_per_averaged_gradient(
    tmp_path,
):
    from dpivon.privacy.accounting import epsilon_spent
    from dpivon.runs import privacy_plan
    from dpivon.search.export import target_config

    pipeline = load_pipeline(_noise_faithful_pipeline(tmp_path))
    n = pipeline.data.train_size  # 540
    target = parse_config({**pipeline.owned_settings("dp-sgd", 8.0), "batch_size": 128})
    target_plan = privacy_plan(target, n)
    trial = parse_config(pipeline.base_train_config("dp-sgd", 8.0))
    plan = privacy_plan(trial, n)
    assert trial.training.batch_size == 32
    # the same steps and the same noise on the averaged gradient, sigma / b
    assert plan.steps == target_plan.steps == 3 * math.ceil(540 / 128)
    assert plan.noise_multiplier / 32 == pytest.approx(target_plan.noise_multiplier / 128)
    # its epsilon is the accountant's for what ran: far above the target's 8
    spent = epsilon_spent(plan.noise_multiplier, 32 / n, plan.steps, 1e-5, "rdp")
    assert trial.privacy.epsilon == spent and spent > 8.0 * 2
    (mechanism,) = pipeline.candidate_mechanisms("dp-sgd", spent)
    assert (mechanism.noise_multiplier, mechanism.sample_rate, mechanism.steps) == (
        plan.noise_multiplier,
        plan.sample_rate,
        plan.steps,
    )
    # the export turns a trial back into the run it stood for: the target's batch and budget
    final = target_config(trial.replace(lr=0.7), 4, 8.0)
    assert final.training.batch_size == 128 and final.training.steps_per_epoch is None
    assert final.privacy.fixed_noise_multiplier is None and final.privacy.epsilon == 8.0
    assert privacy_plan(final, n).noise_multiplier == target_plan.noise_multiplier
    assert final.optimizer.lr == 0.7
    # the target's 3 epochs as 1 trial epoch (one validation): the same steps and noise
    once = load_pipeline(
        _noise_faithful_pipeline(
            tmp_path,
            noise_faithful={"batch_divisor": 4, "trial_epochs": 1},
            scheduler={"type": "none"},  # asha needs two epochs to stop a trial between
        )
    )
    trial_once = parse_config(once.base_train_config("dp-sgd", 8.0))
    assert (trial_once.training.epochs, trial_once.training.steps_per_epoch) == (1, plan.steps)
    assert privacy_plan(trial_once, n).noise_multiplier == plan.noise_multiplier
    assert trial_once.privacy.epsilon == spent


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"epsilons": None, "total_epsilon": 8}, "use epsilons"),
        ({"train": {"batch_size": 130}}, "batch_divisor 4 must divide train.batch_size 130"),
        ({"train": {"bma_samples": 2}}, "set train.batch_size"),
        ({"noise_faithful": {"batch_divisor": 1}}, "batch_divisor"),
        (
            {"noise_faithful": {"batch_divisor": 4, "trial_epochs": 2}},
            "trial_epochs 2 must divide epochs 3",
        ),
    ],
)
def test_a_bad_noise_faithful_pipeline_is_one_clear_error(tmp_path, changes, message):
    path = _noise_faithful_pipeline(tmp_path, **changes)
    line = one_line_refusal(load_pipeline, path)
    assert message in line


@pytest.mark.parametrize("device", ["cuda", {"type": "categorical", "choices": ["cpu", "cuda:0"]}])
def test_a_space_that_runs_on_cuda_needs_a_gpu_per_trial(tmp_path, device):
    """As a pipeline's train: block with device cuda: refused at load, before Ray starts a
    trial that could not see a GPU."""
    space = yaml.safe_load((ROOT / "search_spaces" / "quickstart" / "dp-sgd.yaml").read_text())
    space["params"]["device"] = device
    space.pop("start", None)
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    optimizers = [{"name": "dp-sgd", "space": str(tmp_path / "space.yaml")}]
    path = write_pipeline(tmp_path, optimizers=optimizers)
    with pytest.raises(DpivonError, match=r"params\.device: device cuda(:0)? needs a GPU"):
        load_pipeline(path)
    load_pipeline(write_pipeline(tmp_path, optimizers=optimizers, resources={"cpu": 1, "gpu": 1}))
