"""Resume after the driver is SIGKILLed or stopped by SIGINT / SIGTERM; trials on a two-node
Ray cluster; bad pipelines and clusters that can never run them."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import ray
from fault_injection import known_key_environment
from ray import tune
from ray.cluster_utils import Cluster
from ray.tune.experiment import Trial
from ray.tune.result import SHOULD_CHECKPOINT
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch
from sweep_helpers import REPO, runs_of, sweep_folder, write_pipeline
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.orchestration.ray_cluster import RAY_CONNECT_TIMEOUT_S
from dpivon.search.callbacks import MlflowTrialLogger
from dpivon.search.groups import GROUP_KEY, GroupSearcher
from dpivon.search.pipeline import load_pipeline
from dpivon.search.results import (
    ERROR_TAG,
    GROUP_TAG,
    STATUS_TAG,
    TRIAL_TAG,
    recorded_outcomes,
)
from dpivon.search.sweep import run_sweep
from dpivon.search.trial import (
    COMPLETE,
    DIVERGED,
    DIVERGED_ERROR,
    REPLAYED,
    TrialAlreadyFailed,
)
from dpivon.tracking.client import Tracker

DPIVON = [sys.executable, "-m", "dpivon.cli"]
DP_SGD = {"name": "dp-sgd", "space": str(REPO / "search_spaces/quickstart/dp-sgd.yaml")}


def _sweep_process(pipeline_path, *flags: str, env: dict | None = None) -> subprocess.Popen:
    # A new session: SIGKILL then reaches the driver and the local Ray it started, as when
    # the driver's machine dies.
    return subprocess.Popen(
        [*DPIVON, "sweep", str(pipeline_path), *flags],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=env,
    )


def _wait_until(
    driver: subprocess.Popen, reached: Callable[[], bool], what: str, poll_s: float = 0.5
) -> None:
    deadline = time.time() + 400
    while time.time() < deadline:
        time.sleep(poll_s)
        if reached():
            return
        assert driver.poll() is None, driver.stderr.read().decode()[-3000:]
    pytest.fail(f"the sweep did not reach {what} in time")


def _kill_then_resume(tmp_path, killed_when: Callable[[list], bool], what: str) -> None:
    """SIGKILL a new sweep's driver once its child runs satisfy ``killed_when``, resume it,
    and check that the sweep trained its 4 trials and no more: each ended FINISHED once, no
    trial finished before the kill was trained or written again, and a trial started too
    shortly before the kill for Tune's saved state to hold it ended FAILED as lost."""
    path = write_pipeline(tmp_path, name="killed", concurrency=1, scheduler={"type": "none"})
    pipeline = load_pipeline(path)
    driver = _sweep_process(path)
    _wait_until(
        driver, lambda: killed_when(runs_of(tmp_path, pipeline.experiment)[2]), what, poll_s=0.05
    )
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    _, _, before = runs_of(tmp_path, pipeline.experiment)
    finished_before = {
        c.info.run_id: (c.info.start_time, c.data.tags)
        for c in before
        if c.info.status == "FINISHED"
    }
    open_before = {c.info.run_id for c in before if c.info.status == "RUNNING"}
    assert finished_before, "no trial had finished before the kill"

    resumed = _sweep_process(path, "--resume")
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr.decode()[-3000:]
    client, (parent,), after = runs_of(tmp_path, pipeline.experiment)
    assert parent.info.status == "FINISHED"
    trial_ids = [c.data.tags["dpivon.trial_id"] for c in after]
    assert len(trial_ids) == len(set(trial_ids)) == 4  # no duplicate run, no extra trial
    for child in after:
        error = child.data.tags.get("error", "")
        if error.startswith("lost with the driver"):
            assert child.info.run_id in open_before
            assert child.info.status == "FAILED"
            continue
        assert child.info.status == "FINISHED", error
        epochs = client.get_metric_history(child.info.run_id, "val_accuracy")
        if child.info.run_id in finished_before:  # not run again: one record per epoch
            start_time, tags = finished_before[child.info.run_id]
            assert child.info.start_time == start_time
            # its outcome, checkpoint and config as recorded (the report adds tags)
            assert {k: child.data.tags.get(k) for k in tags} == tags
            assert [m.step for m in epochs] == list(range(1, pipeline.epochs + 1))


@pytest.mark.slow
def test_resume_after_sigkill_runs_no_finished_trial_again(tmp_path):
    def one_finished_and_one_under_way(children: list) -> bool:
        # Under way: it has reported an epoch, so Tune's saved state (every second) has it.
        return any(c.info.status == "FINISHED" for c in children) and any(
            c.info.status == "RUNNING" and "val_accuracy" in c.data.metrics for c in children
        )

    _kill_then_resume(tmp_path, one_finished_and_one_under_way, "a finished and a running trial")


@pytest.mark.slow
def test_resume_after_sigkill_as_a_trial_ended_does_not_train_it_again(tmp_path):
    # Killed within 50 ms of a trial's run turning FINISHED, Tune's saved state (written a
    # moment behind MLflow) mostly still has the trial running, with its final checkpoint
    # (a model, no resume state): the resume must repeat its recorded outcome instead of
    # training it again from there, or failing to.
    _kill_then_resume(
        tmp_path,
        lambda children: any(c.info.status == "FINISHED" for c in children),
        "a finished trial",
    )


def _record_trials(tracker: Tracker, parent: str, ended: dict[str, tuple]) -> None:
    """Child runs of ``parent`` as a sweep's logger leaves them: trial id ->
    (run status, outcome tag, last metrics)."""
    for trial_id, (status, outcome, metrics) in ended.items():
        tags = {TRIAL_TAG: trial_id, STATUS_TAG: outcome, GROUP_TAG: "g"}
        if status == "FAILED":
            tags[ERROR_TAG] = f"{trial_id} at epoch 2"
        run = tracker.start_run(trial_id, parent_run_id=parent, tags=tags)
        tracker.log_metrics(run, metrics, step=2)
        if status != "RUNNING":
            tracker.end_run(run, status)


def test_a_resume_repeats_only_outcomes_mlflow_holds_and_writes_nothing_over_them(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "resume-record")
    parent = tracker.start_run("sweep")
    _record_trials(
        tracker,
        parent,
        {
            "done": ("FINISHED", "completed", {"val_accuracy": 0.5, COMPLETE: 1}),
            "nan": ("FAILED", "diverged", {"val_accuracy": math.nan, DIVERGED: 1}),
            "error": ("FAILED", "failed", {}),
            "lost-driver": ("FAILED", "running", {"val_accuracy": 0.2}),  # closed, no outcome
            "stopped": ("KILLED", "running", {"val_accuracy": 0.3}),  # Ctrl-C: resumes
            "open": ("RUNNING", "running", {"val_accuracy": 0.4}),
        },
    )
    recorded = recorded_outcomes(tracker, parent)
    assert {k: o.failed for k, o in recorded.items()} == {
        "done": False,
        "nan": False,
        "error": True,
    }
    assert recorded["done"].result == {"val_accuracy": 0.5, COMPLETE: 1}
    assert recorded["nan"].result[DIVERGED_ERROR] == "nan at epoch 2"  # for the progress line
    with pytest.raises(TrialAlreadyFailed):
        recorded["error"].report_again()

    # Tune restarts "done" from a state older than MLflow; then "stopped" resumes.
    storage = load_pipeline(write_pipeline(tmp_path)).storage
    logger = MlflowTrialLogger(tracker.tracking_uri, "resume-record", parent, "g", {}, storage)
    runs = tracker.child_runs_by_tag(parent, TRIAL_TAG)
    for trial_id in ("done", "stopped"):
        trial = Trial("t", stub=True, trial_id=trial_id)
        logger.on_trial_start(0, [], trial)
        logger.on_trial_result(0, [], trial, {"val_accuracy": 0.9, "epoch": 3})
        logger.on_trial_complete(0, [], trial)
    after = tracker.child_runs_by_tag(parent, TRIAL_TAG)
    done, stopped = after["done"], after["stopped"]
    assert (done.info.status, done.data.metrics, done.data.tags) == (
        runs["done"].info.status,
        runs["done"].data.metrics,
        runs["done"].data.tags,
    )
    assert stopped.info.status == "FINISHED"
    assert [m.step for m in tracker.metric_history(stopped.info.run_id, "val_accuracy")] == [2, 3]


def test_an_epoch_is_logged_once_tune_registers_its_checkpoint(tmp_path):
    """A node lost between an epoch's report and Tune registering its checkpoint: the trial
    retries that epoch from the previous checkpoint, and MLflow gets the epoch once."""
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "node-loss")
    parent = tracker.start_run("sweep")
    storage = load_pipeline(write_pipeline(tmp_path)).storage
    logger = MlflowTrialLogger(tracker.tracking_uri, "node-loss", parent, "g", {}, storage)

    def report(trial: Trial, epoch: int, accuracy: float) -> None:
        logger.on_trial_result(
            0, [], trial, {"val_accuracy": accuracy, "epoch": epoch, SHOULD_CHECKPOINT: True}
        )

    def logged(trial_id: str) -> list[tuple[int, float]]:
        run = tracker.child_runs_by_tag(parent, TRIAL_TAG)[trial_id]
        return [(m.step, m.value) for m in tracker.metric_history(run.info.run_id, "val_accuracy")]

    moved, failed = (
        Trial("t", stub=True, trial_id="moved"),
        Trial("t", stub=True, trial_id="failed"),
    )
    for trial in (moved, failed):
        logger.on_trial_start(0, [], trial)
        report(trial, 1, 0.1)
        assert logged(trial.trial_id) == []  # not before its checkpoint is registered
        logger.on_checkpoint(0, [], trial, checkpoint=None)
    report(moved, 2, 0.2)
    logger.on_trial_recover(0, [], moved)  # its node died: epoch 2 runs again from epoch 1
    report(moved, 2, 0.25)
    logger.on_checkpoint(0, [], moved, checkpoint=None)
    logger.on_step_end(0, [])
    assert logged("moved") == [(1, 0.1), (2, 0.25)]
    report(moved, 3, 0.3)  # the final result, with the model
    logger.on_checkpoint(0, [], moved, checkpoint=None)
    # its node dies before the trial ends: restored from the model, it says the result again
    logger.on_trial_recover(0, [], moved)
    logger.on_trial_result(0, [], moved, {"val_accuracy": 0.3, "epoch": 3, REPLAYED: 1})
    logger.on_trial_complete(0, [], moved)
    assert logged("moved") == [(1, 0.1), (2, 0.25), (3, 0.3)]

    report(failed, 2, 0.2)
    logger.on_trial_error(0, [], failed)  # out of retries: its last report is its record
    assert logged("failed") == [(1, 0.1), (2, 0.2)]


@dataclasses.dataclass
class _FlakyTrialReader:
    """Trial ids by group, as RecordedTrials reads them from MLflow; the first read fails."""

    trial_ids: dict[str, set[str]]
    reads: int = 0

    def __call__(self) -> dict[str, set[str]]:
        self.reads += 1
        if self.reads == 1:
            raise ConnectionError("MLflow is restarting")
        return self.trial_ids


def test_a_restored_searcher_counts_the_trials_mlflow_has_and_its_state_lacks(tmp_path):
    def study() -> OptunaSearch:
        return OptunaSearch(space={"lr": tune.uniform(0.1, 1.0)}, metric="val_accuracy", mode="max")

    # MLflow has "t1" and "t2"; the driver was lost before Tune saved "t2".
    in_mlflow = _FlakyTrialReader({"g": {"t1", "t2"}, "other": {"x"}})
    searcher = GroupSearcher({"g": study()}, {"g": 4}, in_mlflow)
    assert searcher.suggest("t1")[GROUP_KEY] == "g"
    searcher.save(str(tmp_path / "searcher.pkl"))

    restored = GroupSearcher({}, {}, dict)
    restored.restore(str(tmp_path / "searcher.pkl"))  # reads nothing: Tune restarts on errors
    assert restored.recorded_trials.reads == 0
    with pytest.raises(ConnectionError):  # the sweep stops; its state is as before
        restored.suggest("t3")
    assert restored.suggest("t3")[GROUP_KEY] == "g"  # the third of 4: "t2" counts
    # resumed twice: the state the first resume saved has "t2" already
    restored.save(str(tmp_path / "searcher.pkl"))
    restored.restore(str(tmp_path / "searcher.pkl"))
    assert restored.suggest("t4")[GROUP_KEY] == "g"
    assert restored.suggest("t5") == Searcher.FINISHED


def _files_holding(key: bytes, *folders: Path) -> list[Path]:
    """Every file under ``folders`` that holds ``key`` as bytes, hex or a list of ints."""
    forms = (key, key.hex().encode(), str(list(key)).encode())
    return [
        file
        for folder in folders
        for file in folder.rglob("*")
        if file.is_file()
        and not file.is_symlink()
        and any(form in file.read_bytes() for form in forms)
    ]


@pytest.mark.slow
def test_sigint_and_sigterm_stop_cleanly_and_resume_finishes_the_trial(tmp_path):
    """A secure trial stopped mid-way by Ctrl-C, then by SIGTERM, then resumed to its end:
    each stop leaves the runs KILLED and a resumable sweep, and no file under the sweep's
    folder, its MLflow store or Ray's temporary folder holds the trial's noise key (its
    source patched to a known key, in the driver and in Ray's workers)."""
    key = os.urandom(32)
    ray_tmp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # Ray's socket paths are short
    env = {**known_key_environment(tmp_path / "site", key), "RAY_TMPDIR": str(ray_tmp)}
    path = write_pipeline(
        tmp_path,
        name="stopped",
        trials=1,
        epochs=5,
        optimizers=[DP_SGD],
        scheduler={"type": "none"},
    )
    pipeline = load_pipeline(path)

    def epochs_logged() -> int:
        client, _, children = runs_of(tmp_path, pipeline.experiment)
        return sum(len(client.get_metric_history(c.info.run_id, "val_accuracy")) for c in children)

    # Ctrl-C (the terminal signals the whole process group) after an epoch, then SIGTERM to
    # the resumed driver alone (as `kill` or a container stop) after it logged one more. The
    # count is taken before each start: the trial may log another epoch while the first stop
    # waits for its checkpoint, and a signal must reach a driver that is running trials, not
    # one still importing.
    for number, flags in ((signal.SIGINT, ()), (signal.SIGTERM, ("--resume",))):
        epochs = epochs_logged() + 1
        driver = _sweep_process(path, *flags, env=env)
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
        assert _files_holding(key, tmp_path / "runs", tmp_path / "mlflow.db", ray_tmp) == []

    resumed = _sweep_process(path, "--resume", env=env)
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr.decode()[-3000:]
    client, (parent,), (child,) = runs_of(tmp_path, pipeline.experiment)
    assert parent.info.status == child.info.status == "FINISHED"
    # Each resume went on from the trial's last epoch checkpoint: every epoch ran once.
    history = client.get_metric_history(child.info.run_id, "val_accuracy")
    assert [m.step for m in history] == [1, 2, 3, 4, 5]
    # the trial's attempts (3) drew their keys from the patched source, and none was stored
    drawn = (tmp_path / "site" / "keys-drawn").read_text().split()
    assert len(set(drawn)) >= 3, drawn
    assert _files_holding(key, tmp_path / "runs", tmp_path / "mlflow.db", ray_tmp) == []
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_trials_run_on_both_nodes_of_a_two_node_cluster(tmp_path):
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        path = write_pipeline(
            tmp_path,
            name="cluster",
            trials=2,
            concurrency=2,
            scheduler={"type": "none"},
            optimizers=[DP_SGD],
        )
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
        (
            "name: x\nepsilons: [0]\ntrials: 2\n"
            "optimizers: [{name: dp-sgd, space: nowhere.yaml}]\n",
            "epsilon",
        ),
        (
            "name: x\nepsilons: [8]\ntrials: 2\n"
            "optimizers: [{name: dp-sgd, space: nowhere.yaml}]\n",
            "nowhere.yaml",
        ),
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
