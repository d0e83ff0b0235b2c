"""Resume after the driver is SIGKILLed or stopped by SIGINT / SIGTERM; trials on a two-node
Ray cluster; bad pipelines and clusters that can never run them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import ray
from ray.cluster_utils import Cluster
from sweep_helpers import REPO, runs_of, sweep_folder, write_pipeline
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.orchestration.ray_cluster import RAY_CONNECT_TIMEOUT_S
from dpivon.search.pipeline import load_pipeline
from dpivon.search.sweep import run_sweep

DPIVON = [sys.executable, "-m", "dpivon.cli"]
DP_SGD = {"name": "dp-sgd", "space": str(REPO / "search_spaces/quickstart/dp-sgd.yaml")}


def _sweep_process(pipeline_path, *flags: str) -> subprocess.Popen:
    # A new session: SIGKILL then reaches the driver and the local Ray it started, as when
    # the driver's machine dies.
    return subprocess.Popen([*DPIVON, "sweep", str(pipeline_path), *flags], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def _wait_until(driver: subprocess.Popen, reached: Callable[[], bool], what: str) -> None:
    deadline = time.time() + 400
    while time.time() < deadline:
        time.sleep(0.5)
        if reached():
            return
        assert driver.poll() is None, driver.stderr.read().decode()[-3000:]
    pytest.fail(f"the sweep did not reach {what} in time")


@pytest.mark.slow
def test_resume_after_sigkill_runs_no_finished_trial_again(tmp_path):
    path = write_pipeline(tmp_path, name="killed", concurrency=1, scheduler={"type": "none"})
    pipeline = load_pipeline(path)
    driver = _sweep_process(path)

    def one_finished_and_one_under_way() -> bool:
        # Under way: it has reported an epoch, so Tune's saved state (every second) has it.
        _, _, children = runs_of(tmp_path, pipeline.experiment)
        return any(c.info.status == "FINISHED" for c in children) and any(
            c.info.status == "RUNNING" and "val_accuracy" in c.data.metrics for c in children
        )

    _wait_until(driver, one_finished_and_one_under_way, "a finished and a running trial")
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


@pytest.mark.slow
def test_sigint_and_sigterm_stop_cleanly_and_resume_finishes_the_trial(tmp_path):
    path = write_pipeline(tmp_path, name="stopped", trials=1, epochs=5, optimizers=[DP_SGD],
                          scheduler={"type": "none"})
    pipeline = load_pipeline(path)

    def epochs_logged() -> int:
        client, _, children = runs_of(tmp_path, pipeline.experiment)
        return sum(len(client.get_metric_history(c.info.run_id, "val_accuracy"))
                   for c in children)

    # Ctrl-C (the terminal signals the whole process group) after an epoch, then SIGTERM to
    # the resumed driver alone (as `kill` or a container stop) after it logged one more. The
    # count is taken before each start: the trial may log another epoch while the first stop
    # waits for its checkpoint, and a signal must reach a driver that is running trials, not
    # one still importing.
    for number, flags in ((signal.SIGINT, ()), (signal.SIGTERM, ("--resume",))):
        epochs = epochs_logged() + 1
        driver = _sweep_process(path, *flags)
        _wait_until(driver, lambda e=epochs: epochs_logged() >= e, f"epoch {epochs}")
        if number == signal.SIGINT:
            os.killpg(driver.pid, number)
        else:
            driver.send_signal(number)
        _, stderr = driver.communicate(timeout=120)
        assert driver.returncode == 128 + number, stderr.decode()[-3000:]
        _, (parent,), children = runs_of(tmp_path, pipeline.experiment)
        assert parent.info.status == "KILLED"
        assert [c.info.status for c in children] == ["KILLED"]  # none left RUNNING
        assert "--resume" in stderr.decode()

    resumed = _sweep_process(path, "--resume")
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr.decode()[-3000:]
    client, (parent,), (child,) = runs_of(tmp_path, pipeline.experiment)
    assert parent.info.status == child.info.status == "FINISHED"
    # Each resume went on from the trial's last epoch checkpoint: every epoch ran once.
    history = client.get_metric_history(child.info.run_id, "val_accuracy")
    assert [m.step for m in history] == [1, 2, 3, 4, 5]


def test_trials_run_on_both_nodes_of_a_two_node_cluster(tmp_path):
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        path = write_pipeline(tmp_path, name="cluster", trials=2, concurrency=2,
                              scheduler={"type": "none"}, optimizers=[DP_SGD])
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
    directory = sweep_folder(load_pipeline(path))
    directory.mkdir(parents=True)
    (directory / "sweep.json").write_text("{}")
    result = CliRunner().invoke(app, ["sweep", str(path)])
    assert result.exit_code == 2 and "--resume" in result.output


def test_an_unreachable_ray_address_gives_up_within_seconds(tmp_path):
    if ray.is_initialized():
        ray.shutdown()
    path = write_pipeline(tmp_path, name="unreachable")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        # The backlog holds this one connection; the sweep's is then never answered.
        held = socket.create_connection(server.getsockname())
        try:
            started = time.monotonic()
            address = "{}:{}".format(*server.getsockname())
            result = CliRunner().invoke(app, ["sweep", str(path), "--address", address])
            took = time.monotonic() - started
        finally:
            held.close()
    assert result.exit_code == 2, result.output
    assert f"cannot reach the Ray cluster at {address}" in result.output
    assert "Traceback" not in result.output
    assert took < RAY_CONNECT_TIMEOUT_S + 20
    assert runs_of(tmp_path, load_pipeline(path).experiment)[1:] == ([], [])
