"""The logged model in use: `dpivon predict`, `dpivon serve` on loopback, and the
model's own environment rebuilt in a fresh virtual environment (no dpivon installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import mlflow
import numpy as np
import pytest
from conftest import BIN, CIFAR10_TARBALL, answers, free_port, wait_until
from packaging.requirements import Requirement
from PIL import Image
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.data import CIFAR10_CLASSES

IMAGES = 8
runner = CliRunner()


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> tuple[str, str]:
    """A tiny dp-ivon-gradsq run's model: (tracking URI, model URI)."""
    work = tmp_path_factory.mktemp("serving")
    tracking = f"sqlite:///{work}/mlflow.db"
    out = work / "out.json"
    result = runner.invoke(app, [
        "train", "--dataset", "synthetic", "--set", "synthetic_size=300", "--model", "small-cnn",
        "--optimizer", "dp-ivon-gradsq", "--epochs", "1", "--batch-size", "64",
        "--bma-samples", "2", "--tracking-uri", tracking, "--json", str(out),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    return tracking, f"runs:/{json.loads(out.read_text())['mlflow_run_id']}/model"


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> list[Path]:
    """The first test image of 8 classes from the shared CIFAR-10 tarball, as JPEG files."""
    if not CIFAR10_TARBALL.is_file():
        pytest.fail(f"the CIFAR-10 tarball {CIFAR10_TARBALL} is missing: set DPIVON_DATA to it")
    folder = tmp_path_factory.mktemp("jpegs")
    wanted = {f"cifar10-jpeg/test/{name}/0000.jpg": name for name in CIFAR10_CLASSES[:IMAGES]}
    files = []
    with tarfile.open(CIFAR10_TARBALL) as tar:
        for member in tar:  # the test split comes first: a short scan
            if member.name in wanted:
                files.append(folder / f"{wanted.pop(member.name)}.jpg")
                files[-1].write_bytes(tar.extractfile(member).read())
            if not wanted:
                break
    return sorted(files)


def predict_cli(model_uri: str, tracking: str, *paths: Path, extra: tuple = ()) -> list[dict]:
    result = runner.invoke(
        app, ["predict", model_uri, *map(str, paths), "--json", "--tracking-uri", tracking, *extra]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def post(url: str, payload: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def assert_same_predictions(rows: list[dict], expected: list[dict]) -> None:
    assert len(rows) == len(expected)
    for row, want in zip(rows, expected, strict=True):
        assert (row["class"], row["label"]) == (want["class"], want["label"])
        for key, value in want.items():
            if key not in ("file", "class", "label"):
                # float32 in two processes: a reduction's last bits may differ (how its
                # threads split it), and mutual information, a difference of entropies
                # near 2, inherits their absolute error (a few 1e-7)
                assert row[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


def test_predict_and_mlflow_serve_agree_on_raw_jpegs(logged, jpegs, spawn):
    tracking, model_uri = logged
    expected = predict_cli(model_uri, tracking, *jpegs)
    assert [Path(r["file"]).name for r in expected] == [p.name for p in jpegs]
    for row in expected:
        probs = [row[f"prob_{name}"] for name in CIFAR10_CLASSES]
        assert sum(probs) == pytest.approx(1.0, abs=1e-5)
        assert row["probability"] == max(probs) and row["class"] == int(np.argmax(probs))
        assert 0 <= row["mutual_information"] <= row["entropy"] <= np.log(10) + 1e-6
    # the table a person reads: file, class, probability, entropy
    folder = str(jpegs[0].parent)
    table = runner.invoke(app, ["predict", model_uri, folder, "--tracking-uri", tracking])
    assert table.exit_code == 0, table.output
    for text in ("file", "class", "probability", "entropy", jpegs[0].name, expected[0]["label"]):
        assert text in table.stdout
    # the point prediction has no posterior disagreement to report
    mean = predict_cli(model_uri, tracking, jpegs[0], extra=("--bma-samples", "0"))
    assert "mutual_information" not in mean[0] and mean[0]["entropy"] != expected[0]["entropy"]

    port = free_port()
    server, log = spawn(
        [BIN / "dpivon", "serve", model_uri, "--port", port, "--tracking-uri", tracking],
        "serve",  # its code checked, the model is served by `mlflow models serve`
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: answers(f"{url}/ping"), 180, f"dpivon serve (log: {log})", server)
    pixels = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in jpegs])
    assert pixels.dtype == np.uint8 and pixels.shape == (IMAGES, 32, 32, 3)
    status, answer = post(f"{url}/invocations", {"inputs": pixels.tolist()})
    assert status == 200, answer
    assert_same_predictions(answer["predictions"], expected)
    # the same images channels-first, and as floats in [0, 1]
    channels_first = {"inputs": pixels.transpose(0, 3, 1, 2).tolist()}
    floats = {"inputs": (pixels / 255.0).tolist()}
    for payload in (channels_first, floats):
        status, answer = post(f"{url}/invocations", payload)
        assert status == 200, answer
        assert_same_predictions(answer["predictions"], expected)
    # bad input is one line and a 400, not a server error
    status, answer = post(f"{url}/invocations", {"inputs": (pixels * 1.0).tolist()})
    assert status == 400 and "float images are in [0, 1]" in answer["message"], answer


def dependency_closure(requirements: list[str]) -> set[str]:
    """The installed distributions the requirements need, transitively (markers and extras
    evaluated here)."""
    seen: set[str] = set()
    todo = [(Requirement(line), "") for line in requirements]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        dist = metadata.distribution(requirement.name)
        assert dist.version in requirement.specifier, f"{requirement} but {dist.version} here"
        key = (dist.metadata["Name"].lower(), *sorted(requirement.extras))
        if "|".join(key) in seen:
            continue
        seen.add("|".join(key))
        for line in dist.requires or []:
            for wanted in ("", *requirement.extras):
                todo.append((Requirement(line), wanted))
    return {key.split("|")[0] for key in seen}


def test_model_environment_rebuilds_from_its_requirements(logged, tmp_path):
    """A fresh venv holding only what the model's requirements.txt names (and what those
    need), without dpivon: pip accepts the pins offline, the model loads its dpivon from its
    own code and predicts what the training environment predicts.

    The packages come from this environment's installed files (a view of exactly those
    distributions): torch 2.14.1 and mlflow 3.17.2 are in no local wheelhouse, and downloading
    them (about 6 GB, minutes) is not affordable in every CI run."""
    tracking, model_uri = logged
    mlflow.set_tracking_uri(tracking)
    model_dir = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(tmp_path)))
    requirements = (model_dir / "requirements.txt").read_text().split()
    assert all("==" in line for line in requirements), requirements
    assert (model_dir / "code" / "dpivon" / "tracking" / "served_model.py").is_file()

    view = tmp_path / "site"
    view.mkdir()
    for name in dependency_closure(requirements):
        for top in {f.parts[0] for f in metadata.distribution(name).files if f.parts[0] != ".."}:
            source = Path(metadata.distribution(name).locate_file(top))
            if source.exists() and not (view / top).exists():
                (view / top).symlink_to(source)
    assert not (view / "dpivon").exists() and not list(view.glob("dpivon*"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip())  # fmt: skip
    (site / "model-requirements.pth").write_text(f"{view}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [sys.executable, "-m", "pip", "--python", python]
    installed = subprocess.run(
        [*pip, "install", "--no-index", "-r", model_dir / "requirements.txt"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "Successfully installed" not in installed.stdout  # every pin already satisfied

    images = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    np.save(tmp_path / "images.npy", images)
    script = (
        "import importlib.util, json, sys, mlflow, numpy as np\n"
        "assert importlib.util.find_spec('dpivon') is None, 'dpivon is installed'\n"
        f"model = mlflow.pyfunc.load_model({str(model_dir)!r})\n"
        "assert sys.modules['dpivon'].__file__.startswith(sys.argv[1]), 'dpivon not from code'\n"
        f"rows = model.predict(np.load({str(tmp_path / 'images.npy')!r}))\n"
        "print(json.dumps(rows.to_dict('records')))\n"
    )
    ran = subprocess.run(
        [python, "-c", script, str(model_dir / "code")], env=env, capture_output=True, text=True,
        timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    here = mlflow.pyfunc.load_model(str(model_dir)).predict(images).to_dict("records")
    assert_same_predictions(json.loads(ran.stdout.strip().splitlines()[-1]), here)
