"""Model folders are checked before they load: a logged model whose loader or code is not
the installed dpivon's is refused by `dpivon predict`, `evaluate` and `serve` in one line,
before any of its code runs, unless ``--trust-model-code`` is given."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import mlflow
import numpy as np
import pytest
import yaml
from conftest import BIN, answers, free_port, wait_until
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.tracking import model_trust, served_model
from dpivon.tracking.model_trust import BYTECODE, TRUST_FLAG

runner = CliRunner()


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Iterator[None]:
    """The installed dpivon, as what a model logs and is checked against, is a snapshot of
    it: an edit of the working tree during the tests would otherwise be a difference."""
    package = tmp_path_factory.mktemp("installed") / "dpivon"
    shutil.copytree(model_trust.PACKAGE, package, ignore=shutil.ignore_patterns(BYTECODE))
    entry = package / model_trust.ENTRY_POINT.name
    with pytest.MonkeyPatch.context() as patch:
        for module in (model_trust, served_model):
            patch.setattr(module, "PACKAGE", package)
            patch.setattr(module, "ENTRY_POINT", entry)
        yield


@pytest.fixture(scope="module")
def logged(tmp_path_factory, installed) -> tuple[Path, str, Path]:
    """A tiny dp-ivon-gradsq run's model: (its work folder, its runs:/ URI, a downloaded copy
    of its folder)."""
    work = tmp_path_factory.mktemp("trust")
    out = work / "out.json"
    result = runner.invoke(app, [
        "train", "--dataset", "synthetic", "--set", "synthetic_size=300", "--model", "small-cnn",
        "--optimizer", "dp-ivon-gradsq", "--epochs", "1", "--batch-size", "64",
        "--bma-samples", "2", "--tracking-uri", tracking(work), "--json", str(out),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    model_uri = f"runs:/{json.loads(out.read_text())['mlflow_run_id']}/model"
    mlflow.set_tracking_uri(tracking(work))
    folder = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(work / "pristine")))
    np.save(work / "images.npy", np.zeros((2, 32, 32, 3), dtype=np.uint8))
    return work, model_uri, folder


def tracking(work: Path) -> str:
    return f"sqlite:///{work}/mlflow.db"


def payload(marker: Path) -> str:
    """Python that creates ``marker`` when it runs: as visible as it is harmless."""
    return f"open({str(marker)!r}, 'w').close()\n"


def change_code_file(folder: Path, marker: Path) -> str:
    code = folder / "code" / "dpivon" / "tracking" / "served_model.py"
    code.write_text(code.read_text() + payload(marker))
    return "code/dpivon/tracking/served_model.py differs"


def change_entry_point(folder: Path, marker: Path) -> str:
    entry = folder / "mlflow_model.py"
    entry.write_text(payload(marker) + entry.read_text())
    return "mlflow_model.py is not the installed dpivon's entry point"


def change_loader(folder: Path, marker: Path) -> str:
    """The MLmodel names a loader of the folder's own, which then loads the model as
    MLflow's would."""
    (folder / "code" / "payload_loader.py").write_text(
        payload(marker) + "from mlflow.pyfunc.loaders.code_model import _load_pyfunc  # noqa\n"
    )
    mlmodel = yaml.safe_load((folder / "MLmodel").read_text())
    mlmodel["flavors"]["python_function"]["loader_module"] = "payload_loader"
    (folder / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    return "MLmodel's python_function loader_module is 'payload_loader'"


def add_module(folder: Path, marker: Path) -> str:
    (folder / "code" / "dpivon" / "payload.py").write_text(payload(marker))
    return "code/dpivon/payload.py is not in the installed dpivon"


TAMPERINGS: dict[str, Callable[[Path, Path], str]] = {
    "a code file changed": change_code_file,
    "the entry point changed": change_entry_point,
    "the MLmodel loader changed": change_loader,
    "a module added under code/": add_module,
}


def tampered(logged, tmp_path: Path, how: str) -> tuple[Path, Path, str]:
    """A copy of the logged model's folder tampered ``how``: (the folder, the file its
    payload creates, what the refusal names)."""
    folder = tmp_path / "model"
    shutil.copytree(logged[2], folder)
    marker = tmp_path / "created-by-the-payload"
    return folder, marker, TAMPERINGS[how](folder, marker)


def command(name: str, work: Path, model: str, *extra: str) -> list[str]:
    """``dpivon NAME`` on ``model``, as quick as each command gets."""
    args = {
        "predict": ["predict", model, str(work / "images.npy"), "--json"],
        "evaluate": ["evaluate", model, "--corruption", "contrast", "--severity", "1",
                     "--per-class", "2"],
        "serve": ["serve", model, "--port", str(free_port())],
    }[name]  # fmt: skip
    return [*args, *extra, "--tracking-uri", tracking(work)]


def invoke(args: list[str], work: Path):
    return runner.invoke(app, args, env={"DPIVON_CACHE": str(work / "cache")})


def refusal(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    return lines[0]


@pytest.mark.parametrize("name", ["predict", "evaluate", "serve"])
@pytest.mark.parametrize("how", TAMPERINGS)
def test_a_tampered_model_folder_is_refused_before_its_code_runs(logged, tmp_path, how, name):
    folder, marker, names = tampered(logged, tmp_path, how)
    line = refusal(invoke(command(name, logged[0], str(folder)), logged[0]))
    assert names in line and TRUST_FLAG in line and str(folder) in line, line
    assert "another dpivon or MLflow version" in line, line
    assert not marker.exists()  # the payload never ran


def test_a_tampered_model_is_refused_from_the_tracking_store_too(logged, tmp_path):
    """A runs:/ URI: the check reads the folder downloaded from the store."""
    work, _, _ = logged
    folder, marker, names = tampered(logged, tmp_path, "the entry point changed")
    mlflow.set_tracking_uri(tracking(work))
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(folder), "model")
    uri = f"runs:/{run.info.run_id}/model"
    line = refusal(invoke(command("predict", work, uri), work))
    assert names in line and uri in line and TRUST_FLAG in line, line
    assert not marker.exists()


def test_the_untampered_model_loads_without_the_flag(logged):
    work, model_uri, folder = logged
    for model in (model_uri, str(folder)):
        result = invoke(command("predict", work, model), work)
        assert result.exit_code == 0, result.output
        assert len(json.loads(result.stdout)) == 2
    result = invoke(command("evaluate", work, model_uri), work)
    assert result.exit_code == 0, result.output
    # a folder that was loaded in place (Python wrote bytecode caches into its code/)
    cache = folder / "code" / "dpivon" / "__pycache__"
    cache.mkdir()
    (cache / "errors.cpython-311.pyc").write_bytes(b"forged")
    result = invoke(command("predict", work, str(folder)), work)
    assert result.exit_code == 0, result.output
    shutil.rmtree(cache)


@pytest.mark.parametrize("how", TAMPERINGS)
def test_the_trust_flag_loads_a_tampered_model(logged, tmp_path, how):
    work = logged[0]
    folder, marker, _ = tampered(logged, tmp_path, how)
    result = invoke(command("predict", work, str(folder), TRUST_FLAG), work)
    assert result.exit_code == 0, result.output
    # what the loading process runs: the entry point and the loader; dpivon is imported here
    # already, so neither the changed nor the added module is (a fresh server imports them)
    assert marker.exists() == (how in ("the entry point changed", "the MLmodel loader changed"))
    if how == "the MLmodel loader changed":
        result = invoke(command("evaluate", work, str(folder), TRUST_FLAG), work)
        assert result.exit_code == 0, result.output


def test_the_trust_flag_serves_a_tampered_model(logged, tmp_path, spawn):
    """A served model runs its own code/ copy of dpivon: the changed module runs."""
    folder, marker, _ = tampered(logged, tmp_path, "a code file changed")
    port = free_port()
    server, log = spawn([BIN / "dpivon", "serve", folder, "--port", port, TRUST_FLAG], "serve")
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/ping"), 180, f"dpivon serve ({log})",
               server)  # fmt: skip
    assert marker.exists()


def test_a_store_without_credentials_is_one_line(logged, tmp_path):
    work = logged[0]
    no_credentials = {
        "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SESSION_TOKEN": None,
        "AWS_PROFILE": None, "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_EC2_METADATA_DISABLED": "true",
    }  # fmt: skip
    result = runner.invoke(app, command("predict", work, "s3://bucket/model"), env=no_credentials)
    line = refusal(result)
    assert "cannot load the model s3://bucket/model: Unable to locate credentials" in line, line
