"""Every input checked before anything starts, and one error path that cannot itself fail.

- An exception nobody anticipated, raised inside any command, ends as one line naming the
  command and what it worked on, with a non-zero exit: never a traceback.
- Each refusal of a bad input comes before any MLflow store, sweep folder or output file
  exists, and within seconds (no calibration, data or Ray first).
- Strict loading: duplicate keys, a field sampled twice, null without a meaning, an empty
  condition, a per-optimizer override a space shadows, names, bounded counts, sizes.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from sweep_helpers import REPO, write_pipeline
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.config import load_configs
from dpivon.errors import DpivonError
from dpivon.paths import MAX_INPUT_BYTES, check_writable, read_input_text
from dpivon.privacy.noise import RESEARCH_MODE_WARNING
from dpivon.search.pipeline import load_pipeline
from dpivon.search.space import load_search_space
from dpivon.study.spec import load_benchmark

SPACES = REPO / "search_spaces" / "quickstart"
SYNTHETIC_TRAIN = ["train", "--dataset=synthetic", "--optimizer=dp-sgd", "--epochs=1"]
IVON_TRAIN = ["train", "--dataset=synthetic", "--optimizer=dp-ivon-gradsq", "--epochs=1"]


def invoke(args: list[str], cwd: Path, store: Path, env: dict[str, str] | None = None):
    """``dpivon ARGS`` in ``cwd`` with its MLflow store at ``store`` (and ``env`` set)."""
    with contextlib.chdir(cwd):
        return CliRunner().invoke(app, [str(a) for a in args],
                                  env={"MLFLOW_TRACKING_URI": f"sqlite:///{store}",
                                       **(env or {})})  # fmt: skip


def one_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


# -- the one error path ---------------------------------------------------------------------

# For each command: its arguments (tmp_path for {tmp}) and a function it calls, which the
# test makes raise; the object the error line must name.
COMMANDS = {
    "train": (SYNTHETIC_TRAIN, "dpivon.runs.load_data", "dp-sgd"),
    "sweep": (["sweep", "{tmp}/p.yaml"], "dpivon.search.pipeline.load_pipeline", "p.yaml"),
    "export": (["export", "some-sweep", "--out={tmp}/x.yaml"],
               "dpivon.search.export.resolve_sweep", "some-sweep"),
    "pareto": (["pareto", "some-sweep"], "dpivon.search.export.resolve_sweep", "some-sweep"),
    "benchmark": (["benchmark", "{tmp}/b.yaml"], "dpivon.study.spec.load_benchmark", "b.yaml"),
    "audit": (["audit", "--optimizer=dp-sgd"], "dpivon.audit.audit_config", "dp-sgd"),
}  # fmt: skip
EXCEPTIONS = (
    OSError(28, "No space left on device"),
    KeyError("trial_id"),
    RuntimeError("CUDA error: an illegal memory access"),
    ValueError("bad shape (3,)"),
)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("exception", EXCEPTIONS, ids=lambda e: type(e).__name__)
def test_an_unexpected_exception_in_any_command_is_one_line(
    tmp_path, monkeypatch, command, exception
):
    args, target, subject = COMMANDS[command]
    module, _, name = target.rpartition(".")

    def fail(*args, **kwargs):
        raise exception

    monkeypatch.setattr(f"{module}.{name}", fail)
    result = invoke([a.format(tmp=tmp_path) for a in args], tmp_path, tmp_path / "store.db")
    line = one_line(result)
    assert result.exit_code == (2 if isinstance(exception, ValueError) else 1), line
    assert f"dpivon {command}" in line and subject in line, line
    assert str(exception).strip("'") in line, line
    if not isinstance(exception, ValueError):
        assert type(exception).__name__ in line, line
    assert not (tmp_path / "store.db").exists()


def test_audit_marks_its_optimizer_required(tmp_path):
    result = invoke(["audit", "--help"], tmp_path, tmp_path / "store.db")
    (flag,) = [line for line in result.output.splitlines() if "--optimizer" in line]
    assert "required" in flag, flag
    result = invoke(["audit"], tmp_path, tmp_path / "store.db")
    assert result.exit_code == 2 and "Missing option '--optimizer'" in one_line(result)


# -- refusals before anything exists --------------------------------------------------------


def _benchmark(tmp_path: Path, **changes) -> Path:
    data = {
        "name": "refused", "data": {"dataset": "synthetic", "synthetic_size": 300},
        "model": "small-cnn", "epochs": 1, "epsilons": [8], "seeds": [0, 1, 2],
        "methods": [{"name": "dp-sgd", "optimizer": "dp-sgd", "train": {"batch_size": 64}}],
        "tracking_uri": f"sqlite:///{tmp_path}/store.db", "storage_path": str(tmp_path / "runs"),
        **changes,
    }  # fmt: skip
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _sweep(tmp_path: Path, **changes) -> Path:
    return write_pipeline(tmp_path, name="refused", tracking_uri=f"sqlite:///{tmp_path}/store.db",
                          **changes)  # fmt: skip


# (arguments, part of the message); {tmp}: the test's folder, {file}: a regular file in it
REFUSALS = {
    "train epsilon below the floor": ([*SYNTHETIC_TRAIN, "--epsilon=1e-12"], "smallest"),
    "train epsilon 1e308": ([*SYNTHETIC_TRAIN, "--epsilon=1e308"], "above 1000"),
    "train delta 0.01": ([*SYNTHETIC_TRAIN, "--delta=0.01"], "1/N"),
    "train a device not here": ([*SYNTHETIC_TRAIN, "--device=cuda:99"], "cuda:99"),
    "train --set null": ([*SYNTHETIC_TRAIN, "--set", "lr=null"], "no null value"),
    "train --set twice": ([*SYNTHETIC_TRAIN, "--set", "lr=0.5", "--set", "optimizer.lr=0.7"],
                         "--set optimizer.lr given twice (0.5, then 0.7)"),
    "train --json a directory": ([*SYNTHETIC_TRAIN, "--json={tmp}"], "is a directory"),
    "train --config a directory": (["train", "--config={tmp}"], "is a directory"),
    "audit epsilon below the floor": (["audit", "--optimizer=dp-sgd", "--epsilon=1e-12"],
                                      "smallest"),
    "audit epsilon 1e308": (["audit", "--optimizer=dp-sgd", "--epsilon=1e308"], "above 1000"),
    "audit more canaries than parameters": (["audit", "--optimizer=dp-sgd", "--canaries=10000000"],
                                            "canaries must be in [1, "),
    "export --out a directory": (["export", "any", "--out={tmp}"], "is a directory"),
    "export --out under a file": (["export", "any", "--out={file}/x.yaml"], "which is a file"),
    "pareto --out a directory": (["pareto", "any", "--out={tmp}"], "is a directory"),
    "sweep storage under a file": (["sweep", "sweep:storage_path={file}"], "which is a file"),
    "sweep epsilon below the floor": (["sweep", "sweep:epsilons=[1.0e-12]"], "smallest"),
    "benchmark storage under a file": (["benchmark", "bench:storage_path={file}/x"],
                                       "which is a file"),
    # without credentials GCS waits on a metadata server for minutes; refused within seconds
    "sweep storage on GCS that does not answer": (
        ["sweep", "sweep:storage_path=gs://dpivon-no-such-bucket/runs"],
        "cannot reach gs://dpivon-no-such-bucket/runs/refused"),
    "benchmark storage on GCS that does not answer": (
        ["benchmark", "bench:storage_path=gs://dpivon-no-such-bucket/runs"],
        "cannot reach gs://dpivon-no-such-bucket/runs/refused"),
    "sweep resources beyond this machine": (["sweep", "sweep:resources={{cpu: 4096}}"],
                                            "each trial asks for 4096 CPU and 0 GPU"),
    "benchmark resources beyond this machine": (["benchmark", "bench:resources={{gpu: 64}}"],
                                                "each run asks for 1 CPU and 64 GPU"),
    "sweep device cuda without a GPU per trial": (["sweep", "sweep:train={{device: cuda}}"],
                                                  "device cuda needs a GPU for each run"),
    "benchmark device cuda:0 without a GPU per run": (
        ["benchmark", "bench:train={{device: 'cuda:0'}}"], "device cuda:0 needs a GPU"),
    "benchmark epsilon below the floor": (["benchmark", "bench:epsilons=[1.0e-12]"],
                                          "smallest"),
    "train --shift unknown": ([*SYNTHETIC_TRAIN, "--shift=most"], "--shift takes default or full"),
    "evaluate a missing model": (["evaluate", "{tmp}/no-model"], "does not exist"),
    "evaluate an unknown corruption": (["evaluate", "{file}", "--corruption=fogg"],
                                       "unknown corruption 'fogg'"),
    "evaluate severity 6": (["evaluate", "{file}", "--severity=6"], "from 1 to 5, got 6"),
    "evaluate a file that is no model": (["evaluate", "{file}"],
                                         "is not a file dpivon wrote"),
    "evaluate --json a directory": (["evaluate", "{file}", "--json={tmp}"], "is a directory"),
    # sizes and counts: bounded where the config validates itself, with what a value costs
    "train ece_bins 10^12": ([*SYNTHETIC_TRAIN, "--set", "ece_bins=1000000000000"],
                             "evaluation.ece_bins=1,000,000,000,000 would need 80 TB"),
    "train ece_bins 10^7": ([*SYNTHETIC_TRAIN, "--set", "evaluation.ece_bins=10000000"],
                            "at most 10,000"),
    "train mc_samples 10^8": ([*IVON_TRAIN, "--set", "mc_samples=100000000"],
                              "optimizer.mc_samples=100,000,000 would run 100,000,000 forward"),
    "train val_bma_samples 10^9": ([*IVON_TRAIN, "--val-bma-samples=1000000000"],
                                   "evaluation.val_bma_samples=1,000,000,000 would predict"),
    "train bma_samples 10^9": ([*IVON_TRAIN, "--bma-samples=1000000000"], "at most 1,000"),
    "train synthetic_size 10^12": ([*SYNTHETIC_TRAIN, "--set", "synthetic_size=1000000000000"],
                                   "data.synthetic_size=1,000,000,000,000 would need 15 PB"),
    "audit synthetic_size 10^12": (["audit", "--optimizer=dp-sgd",
                                    "--synthetic-size=1000000000000"], "would need 15 PB"),
    "predict --bma-samples 10^9": (["predict", "runs:/x/model", "{file}",
                                    "--bma-samples=1000000000"],
                                   "--bma-samples=1,000,000,000 would predict every image"),
    "evaluate --bma-samples 10^9": (["evaluate", "{file}", "--bma-samples=1000000000"],
                                    "at most 1,000"),
    "predict --seed 2^70": (["predict", "runs:/x/model", "{file}", f"--seed={2**70}"],
                            "--seed must be in [0, 2**32)"),
    "evaluate --seed 2^70": (["evaluate", "{file}", f"--seed={2**70}"],
                             "--seed must be in [0, 2**32)"),
    "sweep epsilons [yes]": (["sweep", "sweep:epsilons=[8.0, yes]"],
                             "epsilons.1 takes no boolean, got True"),
    "train --tracking-uri in /proc": ([*SYNTHETIC_TRAIN, "--tracking-uri=sqlite:////proc/m.db"],
                                      "/proc/m.db cannot be written"),
    "train --tracking-uri a directory": ([*SYNTHETIC_TRAIN, "--tracking-uri=sqlite:///{tmp}"],
                                         "is a directory, not a regular file"),
    "sweep trial_epochs 10^9": (["sweep", "sweep:noise_faithful={{batch_divisor: 2, "
                                 "trial_epochs: 1000000000}}"], "trial_epochs must be in [1, 1"),
    # each was checked only once Ray or the MLflow run had started
    "sweep a missing data path": (["sweep", "sweep:data={{dataset: cifar10, data_path: "
                                   "/nonexistent/cifar10.tar.gz}}"],
                                  "data path /nonexistent/cifar10.tar.gz does not exist"),
    "benchmark a missing data path": (["benchmark", "bench:data={{dataset: cifar10, data_path: "
                                       "/nonexistent/cifar10.tar.gz}}"],
                                      "data path /nonexistent/cifar10.tar.gz does not exist"),
    "audit a missing data path": (["audit", "--optimizer=dp-sgd", "--dataset=cifar10",
                                   "--data-path=/nonexistent/cifar10.tar.gz"],
                                  "data path /nonexistent/cifar10.tar.gz does not exist"),
    "audit a batch above N": (["audit", "--optimizer=dp-sgd", "--batch-size=5000"],
                              "batch size 5000 is larger than the training set"),
    "audit engine ghost": (["audit", "--optimizer=dp-sgd", "--set", "privacy.engine=ghost"],
                           "the audit cannot put canaries into engine ghost's clipping"),
    "train --tracking-uri not a URI": ([*SYNTHETIC_TRAIN, "--tracking-uri=https://[::1"],
                                       "--tracking-uri (or a run file's tracking_uri:) "
                                       "'https://[::1' is not a valid URI: Invalid IPv6 URL"),
    "train --set nested deeper than Python recurses": (
        [*SYNTHETIC_TRAIN, "--set", "lr=" + "[" * 5000 + "]" * 5000],
        "--set lr: '[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[...' is not a YAML value"),
    # found by tests/memory_probe.py: each overflowed float32 or the accountant's arithmetic
    "train lr 3.4e37": (["train", "--dataset=synthetic", "--optimizer=adam", "--lr=3.4e37"],
                        "lr must be in (0, 1e+06] (larger values overflow float32"),
    "train weight_decay 3.5e38": ([*SYNTHETIC_TRAIN, "--weight-decay=3.5e38"],
                                  "weight_decay must be in [0, 1e+06]"),
    "train hess_init 1e300": ([*IVON_TRAIN, "--hess-init=1e300"],
                              "hess_init must be in (0, 1e+06]"),
    "train hess_floor 3.5e38": ([*IVON_TRAIN, "--set", "hess_floor=3.5e38"],
                                "hess_floor must be in [0, 1e+06]"),
    "train second_moment_floor 1e300": (["train", "--dataset=synthetic", "--optimizer=dp-adambc",
                                         "--set", "second_moment_floor=1.0e300"],
                                        "second_moment_floor must be in (0, 1e+06]"),
    "train max_grad_norm 1e300": ([*SYNTHETIC_TRAIN, "--max-grad-norm=1e300"],
                                  "max_grad_norm must be in (0, 1e+06]"),
    "train fixed_noise_multiplier 1e154": ([*SYNTHETIC_TRAIN, "--set",
                                            "fixed_noise_multiplier=1.0e154"],
                                           "fixed_noise_multiplier must be in (0, 1e+06]"),
    "train fixed_noise_multiplier 5e-324": ([*SYNTHETIC_TRAIN, "--set",
                                             "fixed_noise_multiplier=5.0e-324"],
                                            "spends epsilon inf (rdp, delta 1e-05)"),
    # a float that is not finite, unless the field says what .inf means (epsilon: no noise)
    "train weight_decay .inf": ([*SYNTHETIC_TRAIN, "--set", "weight_decay=.inf"],
                                "weight_decay must be a finite number in [0, 1e+06]"),
    "train hess_init .inf": ([*IVON_TRAIN, "--set", "hess_init=.inf"],
                             "hess_init must be a finite number in (0, 1e+06]"),
    "train hess_floor .inf": ([*IVON_TRAIN, "--set", "hess_floor=.inf"],
                              "hess_floor must be a finite number in [0, 1e+06]"),
    "train hess_floor .nan": ([*IVON_TRAIN, "--set", "hess_floor=.nan"], "got nan"),
    "train ess .inf": ([*IVON_TRAIN, "--set", "ess=.inf"], "ess must be a finite number"),
    "train val_noise_multiplier .inf": ([*SYNTHETIC_TRAIN, "--set", "val_noise_multiplier=.inf"],
                                        "val_noise_multiplier must be a finite number"),
    "train second_moment_floor .inf": (["train", "--dataset=synthetic", "--optimizer=dp-adambc",
                                        "--set", "second_moment_floor=.inf"],
                                       "second_moment_floor must be a finite number in (0, 1e+06]"),
    "sweep validation_noise .inf": (["sweep", "sweep:validation_noise=.inf"],
                                    "validation_noise must be a finite number >= 0"),
    "sweep ASHA reduction_factor .inf": (["sweep", "sweep:scheduler={{type: asha, "
                                          "reduction_factor: .inf}}"],
                                         "scheduler.reduction_factor: must be a finite number"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refusal_comes_first_in_one_line_and_leaves_nothing_behind(tmp_path, case):
    args, message = REFUSALS[case]
    work = tmp_path / "work"
    work.mkdir()
    regular = tmp_path / "a-file"
    regular.write_text("not a folder\n")
    filled = []
    for arg in args:
        arg = arg.format(tmp=work, file=regular)
        if arg.startswith(("sweep:", "bench:")):  # a run file with one key changed
            kind, _, change = arg.partition(":")
            key, _, value = change.partition("=")
            write = _sweep if kind == "sweep" else _benchmark
            arg = str(write(tmp_path, **{key: yaml.safe_load(value)}))
        filled.append(arg)
    started = time.perf_counter()
    result = invoke(filled, work, tmp_path / "store.db")
    seconds = time.perf_counter() - started
    line = one_line(result)
    assert result.exit_code != 0 and message in line, line
    assert seconds < 5, f"refused after {seconds:.1f} s"
    # nothing was created: no MLflow store, no sweep or benchmark folder, no output file
    assert not (tmp_path / "store.db").exists() and not (tmp_path / "runs").exists()
    assert sorted(p.name for p in work.iterdir()) == []
    assert regular.read_text() == "not a folder\n"


@pytest.mark.parametrize("command", ["train", "sweep", "benchmark"])
def test_research_mode_is_said_once_on_the_console_of_every_command_that_trains(tmp_path, command):
    """Nothing a research-mode command releases has a DP guarantee: it says so once, before
    it trains (a sweep or benchmark is then refused for its resources: cheaply); in secure
    mode, the default, it does not."""

    def arguments(research: bool) -> list:
        if command == "train":
            mode = "--research-mode" if research else "--no-research-mode"
            return [
                *SYNTHETIC_TRAIN,
                "--model=small-cnn",
                "--set",
                "synthetic_size=100",
                "--set",
                "val_size=10",
                "--batch-size=30",
                "--bma-samples=0",
                mode,
            ]
        write = _sweep if command == "sweep" else _benchmark
        return [command, write(tmp_path, research_mode=research, resources={"cpu": 4096})]

    warning = f"warning: {RESEARCH_MODE_WARNING}"
    for research in (True, False):
        result = invoke(arguments(research), tmp_path, tmp_path / f"{research}.db")
        assert result.exit_code == (0 if command == "train" else 2), result.output
        said = " ".join(result.output.split()).count(warning)
        assert said == (1 if research else 0), result.output


# -- special files: refused by what they are, never opened (a FIFO's open blocks) -----------

SPECIAL_FILES = {
    "FIFO": (os.mkfifo, "is a FIFO (named pipe)"),
    "directory": (os.mkdir, "is a directory"),
    "symlink loop": (lambda path: os.symlink(path, path), "Too many levels of symbolic links"),
}
# the commands that read a file the user names; {path}: the special file
FILE_READERS = {
    "train --config": ["train", "--config={path}"],
    "train --checkpoint": [*SYNTHETIC_TRAIN, "--checkpoint={path}"],
    "predict": ["predict", "runs:/x/model", "{path}"],
    "predict a folder holding it": ["predict", "runs:/x/model", "{folder}"],
    "evaluate": ["evaluate", "{path}"],
}
# a folder is what predict and evaluate take (images, a model folder): no special file there
_FOLDER_INPUTS = ("predict", "predict a folder holding it", "evaluate")
SPECIAL_FILE_CASES = [
    (command, kind)
    for command in FILE_READERS
    for kind in SPECIAL_FILES
    if not (kind == "directory" and command in _FOLDER_INPUTS)
]


@pytest.mark.timeout(60)  # a blocking open would hang here
@pytest.mark.parametrize(("command", "kind"), SPECIAL_FILE_CASES)
def test_a_special_file_is_refused_by_what_it_is_without_opening_it(tmp_path, command, kind):
    make, what = SPECIAL_FILES[kind]
    folder = tmp_path / "in"
    folder.mkdir()
    # a folder's images are found by their suffix; a batch is a .npy file
    path = folder / ("x.png" if command == "predict a folder holding it" else "x.npy")
    make(path)
    args = [a.format(path=path, folder=folder) for a in FILE_READERS[command]]
    started = time.perf_counter()
    result = invoke(args, tmp_path, tmp_path / "store.db")
    line = one_line(result)
    assert result.exit_code == 2 and what in line and str(path) in line, line
    assert "not found" not in line, line
    assert time.perf_counter() - started < 5
    assert not (tmp_path / "store.db").exists()


@pytest.mark.parametrize("value", ["abc", "-1", "inf"])
def test_a_bad_environment_variable_is_named_before_the_sweep_starts(tmp_path, value):
    started = time.perf_counter()
    result = invoke(["sweep", _sweep(tmp_path)], tmp_path, tmp_path / "store.db",
                    env={"DPIVON_TRACKING_WAIT_S": value})  # fmt: skip
    line = one_line(result)
    assert result.exit_code == 2 and "DPIVON_TRACKING_WAIT_S" in line and value in line, line
    assert time.perf_counter() - started < 5
    assert not (tmp_path / "store.db").exists() and not (tmp_path / "runs").exists()


# -- strict loading -------------------------------------------------------------------------


def _refused(load, path: Path, *parts: str) -> str:
    with pytest.raises(DpivonError) as info:
        load(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    for part in parts:
        assert part in message, message
    assert "errors.pydantic.dev" not in message and "Input should" not in message, message
    return message


def test_a_duplicate_key_is_refused_with_its_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer: dp-sgd\nlr: 0.1\nepochs: 2\nlr: 0.2\n")
    _refused(load_configs, path, "'lr' given twice", "line 4")
    path.write_text("optimizer: dp-sgd\nprivacy: {epsilon: 1.0, epsilon: 2.0}\n")
    _refused(load_configs, path, "'epsilon' given twice")
    # a key that a merge (<<) brings in may be overridden: that is no duplicate
    path.write_text("- &a {optimizer: dp-sgd, dataset: synthetic, lr: 0.1}\n- {<<: *a, lr: 0.2}\n")
    assert [c.optimizer.lr for c in load_configs(path)] == [0.1, 0.2]


LOOK_ALIKE = "\u0435psilon"  # "epsilon" with a Cyrillic e


@pytest.mark.parametrize("text", [f"{LOOK_ALIKE}: 2.0", f"privacy: {{{LOOK_ALIKE}: 2.0}}"])
def test_a_key_with_a_look_alike_character_says_which_and_what_was_meant(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(f"optimizer: dp-sgd\n{text}\n", encoding="utf-8")
    message = _refused(load_configs, path, "unknown key", "did you mean ", "epsilon")
    assert "'\u0435' is U+0435 CYRILLIC SMALL LETTER IE, not an ASCII letter" in message
    result = invoke([*SYNTHETIC_TRAIN, "--set", f"{LOOK_ALIKE}=2"], tmp_path, tmp_path / "s.db")
    line = one_line(result)
    assert result.exit_code == 2 and "did you mean epsilon?" in line and "U+0435" in line, line


TYPOS = [  # (a config file's text, the same typo with --set, the key the line suggests)
    ("optimizer: dp-sgd\nlearnig_rate: 0.1", "learnig_rate=0.1", "lr"),
    ("optimizer: {name: dp-sgd, learnig_rate: 0.1}", "optimizer.learnig_rate=0.1", "optimizer.lr"),
    ("optimizer: {name: dp-sgd, hess_int: 1.0}", "optimizer.hess_int=1.0", "optimizer.hess_init"),
    ("optimizer: dp-sgd\ntraining: {epohcs: 3}", "training.epohcs=3", "training.epochs"),
]


@pytest.mark.parametrize(("text", "assignment", "meant"), TYPOS)
def test_a_config_files_typo_gets_the_suggestion_that_set_gets(tmp_path, text, assignment, meant):
    path = tmp_path / "c.yaml"
    path.write_text(f"{text}\n")
    message = _refused(load_configs, path, f"did you mean {meant}")
    line = one_line(invoke([*SYNTHETIC_TRAIN, "--set", assignment], tmp_path, tmp_path / "s.db"))
    assert f"did you mean {meant}" in line, (line, message)


# Libraries that take seconds to import: a mistake is refused before any of them loads
HEAVY_LIBRARIES = ("torch", "ray", "mlflow", "optuna", "opacus")
_LOADED = f"import sys; print([m for m in {HEAVY_LIBRARIES!r} if m in sys.modules])"


def test_the_cli_module_imports_no_heavy_library():
    """The regression guard of `dpivon --help` and the refusals in a second (issue 47):
    what a command needs, it imports in its body."""
    out = subprocess.run([sys.executable, "-c", f"import dpivon.cli; {_LOADED}"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--dataset=cifar10", "--optimizer=dp-sgd", "--data-path=/nonexistent.tar.gz"],
        ["train", "--config={typo}"],
        ["train", "--dataset=synthetic", "--optimizer=dp-sgd", "--epsilon=0"],
    ],
    ids=["a missing data path", "a config typo", "epsilon 0"],
)
def test_a_mistake_is_refused_before_any_heavy_library_loads(tmp_path, args):
    typo = tmp_path / "c.yaml"
    typo.write_text("optimizer: dp-sgd\nlearnig_rate: 0.1\n")
    args = [a.format(typo=typo) for a in args]
    code = (
        f"import sys; from dpivon.cli import app\ntry: app({args!r})\n"
        f"except SystemExit as stop: print(stop.code); {_LOADED}"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "DPIVON_DATA": ""})  # fmt: skip
    assert out.stdout.split() == ["2", "[]"], (out.stdout, out.stderr)
    assert out.stderr.startswith("error: "), out.stderr


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    """A few lines whose aliases expand to 16 million numbers: the message shows the value
    cut short, without first writing all of it out (that took 5-10 s)."""
    bomb = (
        "[&a [1,1,1,1,1,1,1,1], "
        + ", ".join(f"&{b} [{', '.join([f'*{a}'] * 8)}]" for a, b in itertools.pairwise("abcdefgh"))
        + "]"
    )
    path = tmp_path / "c.yaml"
    for text in (f"lr: {bomb}", f"x: {bomb}"):  # a wrong value, an unknown key
        path.write_text(f"optimizer: dp-sgd\n{text}\n")
        started = time.process_time()
        _refused(load_configs, path)
        assert time.process_time() - started < 1


def test_a_file_too_large_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"lr: 0.1\n" + b"# padding\n" * (MAX_INPUT_BYTES // 10 + 1))
    started = time.perf_counter()
    _refused(load_configs, path, f"{MAX_INPUT_BYTES:,} bytes")
    assert time.perf_counter() - started < 1


def test_a_space_samples_a_field_once_and_when_is_never_empty(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("optimizer: dp-sgd\nparams:\n  lr: {type: float, low: 0.1, high: 1.0}\n"
                    "  optimizer.lr: {type: float, low: 1.0, high: 2.0}\n")  # fmt: skip
    _refused(load_search_space, path, "optimizer.lr and lr both set lr")
    path.write_text("optimizer: dp-sgd\nparams:\n  lr: {type: float, low: 0.1, high: 1.0, "
                    "when: {}}\n")  # fmt: skip
    _refused(load_search_space, path, "params.lr", "when is empty")


def test_a_per_optimizer_override_that_the_space_shadows_is_refused(tmp_path):
    dp_sgd = {"name": "dp-sgd", "space": str(SPACES / "dp-sgd.yaml"), "train": {"lr": 0.5}}
    path = write_pipeline(tmp_path, optimizers=[dp_sgd])
    _refused(load_pipeline, path, "lr set both under optimizers.0.train:", "keep one")


def test_counts_have_upper_bounds_that_say_why(tmp_path):
    _refused(load_pipeline, write_pipeline(tmp_path, trials=10**6), "trials must be in [1, 10000]",
             "each trial a whole training run")  # fmt: skip
    _refused(load_pipeline, write_pipeline(tmp_path, max_failures=10**4), "max_failures", "retries")
    _refused(load_benchmark, _benchmark(tmp_path, concurrency=10**6), "concurrency", "in flight")


@pytest.mark.parametrize("name", ["dp sgd", "dp/sgd", "-x", ""])
def test_a_method_name_is_an_identifier(tmp_path, name):
    methods = [{"name": name, "optimizer": "dp-sgd", "train": {"batch_size": 64}}]
    _refused(load_benchmark, _benchmark(tmp_path, methods=methods), "method name")


def test_a_truncated_sweep_state_names_its_file(tmp_path):
    folder = tmp_path / "runs" / "cut"
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text('{"name": "cut", "pipeline_path": "p.yaml", "tra')
    result = invoke(["pareto", str(folder), f"--out={tmp_path}/p.png"], tmp_path,
                    tmp_path / "store.db")  # fmt: skip
    line = one_line(result)
    assert result.exit_code == 2 and str(folder / "sweep.json") in line, line
    assert "not valid JSON" in line, line


def test_an_existing_output_file_is_replaced_but_a_path_under_a_file_is_refused(tmp_path):
    """A second `--json out.json` (a resumed run) writes over its file; nothing is left."""
    existing = tmp_path / "out.json"
    existing.write_text("{}")
    check_writable(existing, "--json")
    with pytest.raises(DpivonError, match=r"is under .*out\.json, which is a file, not a folder"):
        check_writable(existing / "x.json", "--json")
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_config_on_standard_input_is_read_through_a_pipe(tmp_path, monkeypatch):
    """`--config -` (or /dev/stdin) reads the piped config, checked like a file's; a
    terminal on standard input is refused in one line instead of a wait for input."""
    store = tmp_path / "store.db"
    piped = "optimizer: dp-sgd\ndataset: synthetic\nsynthetic_size: 200\nepochs: 1\n"
    args = [
        "train",
        "--config",
        "-",
        "--batch-size",
        "64",
        "--no-log-model",
        "--json",
        tmp_path / "out.json",
        "--tracking-uri",
        f"sqlite:///{store}",
    ]
    with contextlib.chdir(tmp_path):
        result = CliRunner().invoke(app, [str(a) for a in args], input=piped)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out.json").read_text())["optimizer"] == "dp-sgd"
    with contextlib.chdir(tmp_path):
        result = CliRunner().invoke(
            app, ["train", "--config", "/dev/stdin"], input="optimizer: dp-sgd\nepsilonn: 3\n"
        )
    assert result.exit_code == 2 and "epsilonn: unknown key" in one_line(result)
    monkeypatch.setattr(sys, "stdin", _Terminal())
    with pytest.raises(DpivonError, match="standard input, which is a terminal"):
        read_input_text(Path("-"), "config")


# -- files whose unpickling would run code: every reader loads weights only ---------------


class _CreatesAFile:
    """Unpickled, this opens (creates) ``path``: a payload as harmless as it is visible."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


PICKLED_FILE_READERS = {
    "train --checkpoint": [*SYNTHETIC_TRAIN, "--checkpoint={pt}"],
    "evaluate a model file": ["evaluate", "{pt}"],
    "predict with a model file": ["predict", "{pt}", "{batch}"],
}


@pytest.mark.parametrize("command", PICKLED_FILE_READERS)
def test_a_file_whose_unpickling_runs_code_is_refused_and_runs_nothing(tmp_path, command):
    import numpy as np
    import torch

    marker = tmp_path / "created-by-the-payload"
    pt = tmp_path / "model.pt"
    torch.save({"config": _CreatesAFile(str(marker)), "model_state": {}, "posterior": None,
                "mlflow_run_id": "x"}, pt)  # fmt: skip
    batch = tmp_path / "images.npy"
    np.save(batch, np.zeros((2, 32, 32, 3), dtype=np.uint8))
    args = [a.format(pt=pt, batch=batch) for a in PICKLED_FILE_READERS[command]]
    result = invoke(args, tmp_path, tmp_path / "store.db")
    line = one_line(result)
    assert result.exit_code == 2 and str(pt) in line, line
    assert not marker.exists()  # the payload never ran
    assert not (tmp_path / "store.db").exists()
