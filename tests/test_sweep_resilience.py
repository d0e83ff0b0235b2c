"""Resume after the driver is SIGKILLed; trials on a two-node Ray cluster; bad pipelines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ray
from ray.cluster_utils import Cluster
from sweep_helpers import REPO, runs_of, write_pipeline
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.search.pipeline import load_pipeline
from dpivon.search.sweep import run_sweep, sweep_directory

DPIVON = [sys.executable, "-m", "dpivon.cli"]


def _sweep_process(pipeline_path, *flags: str) -> subprocess.Popen:
    # A new session: SIGKILL then reaches the driver and the local Ray it started, as when
    # the driver's machine dies.
    return subprocess.Popen([*DPIVON, "sweep", str(pipeline_path), *flags], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def test_resume_after_sigkill_runs_no_finished_trial_again(tmp_path):
    path = write_pipeline(tmp_path, name="killed", concurrency=1, scheduler={"type": "none"})
    pipeline = load_pipeline(path)
    state_file = sweep_directory(pipeline) / "sweep.json"
    driver = _sweep_process(path)
    deadline = time.time() + 400
    # Kill once the first optimizer's trials are done and the second one's are under way.
    while time.time() < deadline:
        time.sleep(1)
        if state_file.exists() and json.loads(state_file.read_text())["groups_done"]:
            _, _, children = runs_of(tmp_path, pipeline.experiment)
            if any(c.info.status == "RUNNING" for c in children):
                break
        assert driver.poll() is None, driver.stderr.read().decode()[-3000:]
    else:
        pytest.fail("the sweep did not reach its second group in time")
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    _, _, before = runs_of(tmp_path, pipeline.experiment)
    finished_before = {c.info.run_id: c.info.start_time for c in before
                       if c.info.status == "FINISHED"}
    assert finished_before, "no trial had finished before the kill"

    resumed = _sweep_process(path, "--resume")
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr.decode()[-3000:]
    client, (parent,), after = runs_of(tmp_path, pipeline.experiment)
    assert parent.info.status == "FINISHED"
    trial_ids = [c.data.tags["dpivon.trial_id"] for c in after]
    assert len(trial_ids) == len(set(trial_ids)) == 4  # no duplicate runs
    for child in after:
        assert child.info.status == "FINISHED"
        epochs = client.get_metric_history(child.info.run_id, "val_accuracy")
        if child.info.run_id in finished_before:  # not run again: one record per epoch
            assert child.info.start_time == finished_before[child.info.run_id]
            assert [m.step for m in epochs] == list(range(1, pipeline.epochs + 1))


def test_trials_run_on_both_nodes_of_a_two_node_cluster(tmp_path):
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        path = write_pipeline(tmp_path, name="cluster", trials=2, concurrency=2,
                              scheduler={"type": "none"}, optimizers=[
                                  {"name": "dp-sgd", "space": str(
                                      REPO / "search_spaces/quickstart/dp-sgd.yaml")}])
        pipeline = load_pipeline(path)
        run_sweep(pipeline, address=cluster.address)
    finally:
        ray.shutdown()
        cluster.shutdown()
    _, _, children = runs_of(tmp_path, pipeline.experiment)
    assert len(children) == 2
    assert len({c.data.tags["ray.node_id"] for c in children}) == 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("name: x\nepsilons: [8\n", "not valid YAML"),
        ("name: x\nepsilons: [8]\ntrials: 2\noptimizers: []\nbogus: 1\n", "bogus"),
        ("name: x\nepsilons: [0]\ntrials: 2\n"
         "optimizers: [{name: dp-sgd, space: nowhere.yaml}]\n", "epsilon"),
        ("name: x\nepsilons: [8]\ntrials: 2\n"
         "optimizers: [{name: dp-sgd, space: nowhere.yaml}]\n", "nowhere.yaml"),
    ],
)
def test_bad_pipeline_gives_one_clear_line(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    result = CliRunner().invoke(app, ["sweep", str(path)])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) <= 3  # one line, wrapped at most


def test_bad_search_space_gives_one_clear_line(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("optimizer: dp-sgd\nparams:\n  lr: {type: float, low: 1.0, high: 0.1}\n")
    path = write_pipeline(tmp_path, optimizers=[{"name": "dp-sgd", "space": str(space)}])
    result = CliRunner().invoke(app, ["sweep", str(path)])
    assert result.exit_code == 2
    assert "space.yaml" in result.output and "Traceback" not in result.output


def test_existing_sweep_needs_resume(tmp_path):
    path = write_pipeline(tmp_path)
    directory = sweep_directory(load_pipeline(path))
    directory.mkdir(parents=True)
    (directory / "sweep.json").write_text("{}")
    result = CliRunner().invoke(app, ["sweep", str(path)])
    assert result.exit_code == 2 and "--resume" in result.output
