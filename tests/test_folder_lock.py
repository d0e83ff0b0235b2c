"""One driver per run folder (`dpivon.orchestration.folder_lock`): the lock itself, a sweep
and a benchmark refused before MLflow and Ray, and two real `dpivon sweep` drivers started
on one folder at once."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import sys
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path

import pytest
from conftest import wait_until
from sweep_helpers import REPO, runs_of, sweep_folder, write_pipeline
from test_benchmark import write_benchmark
from typer.testing import CliRunner

from dpivon.cli import app
from dpivon.errors import DpivonError
from dpivon.orchestration import folder_lock
from dpivon.orchestration.folder_lock import LOCK_FILE, FolderLock, Holder
from dpivon.orchestration.storage import ResultsStorage
from dpivon.search.pipeline import load_pipeline
from dpivon.study.spec import load_benchmark

DPIVON = [sys.executable, "-m", "dpivon.cli"]
REFUSED = "another driver holds"
DP_SGD = {"name": "dp-sgd", "space": str(REPO / "search_spaces/quickstart/dp-sgd.yaml")}

# Other drivers: forked, so that they start in milliseconds (this process has imported all)
FORK = multiprocessing.get_context("fork")


def _hold(folder: Path, ready: Barrier, results: Queue, release: Event) -> None:
    """A driver in a process of its own: takes ``folder`` once all are ready, says how it
    went, and holds the folder until ``release``."""
    lock = FolderLock(ResultsStorage.at(str(folder)), "sweep 'sweep'")
    ready.wait()
    try:
        lock.acquire()
    except DpivonError as err:
        results.put(str(err))
        return
    results.put("held")
    release.wait()
    lock.release()


def _holders(folder: Path, count: int) -> tuple[list, list[str], Event]:
    """``count`` drivers forked at once on ``folder``: (processes, what each said, the
    event that ends the one that holds it)."""
    ready, results, release = FORK.Barrier(count), FORK.Queue(), FORK.Event()
    processes = [
        FORK.Process(target=_hold, args=(folder, ready, results, release)) for _ in range(count)
    ]
    for process in processes:
        process.start()
    return processes, [results.get(timeout=60) for _ in processes], release


def _holder_of(folder: Path) -> dict:
    return json.loads((folder / LOCK_FILE).read_text())


def _ended_pid() -> int:
    """The PID of a process of this host that has ended."""
    process = FORK.Process(target=int)
    process.start()
    process.join()
    return process.pid


def test_the_folder_is_held_then_left_as_it_was(tmp_path):
    storage = ResultsStorage(str(tmp_path / "runs"), "sweep")
    folder = Path(storage.path)
    with FolderLock(storage, "sweep 'sweep'"):
        holder = _holder_of(folder)
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
        assert sorted(p.name for p in folder.iterdir()) == [LOCK_FILE]  # no temporary file
    # it made the folder and its parent; nothing else was written there: both go
    assert not (tmp_path / "runs").exists()

    with FolderLock(storage, "sweep 'sweep'"):
        (folder / "sweep.json").write_text("{}")  # what the driver writes stays
    assert sorted(p.name for p in folder.iterdir()) == ["sweep.json"]


def test_a_second_driver_is_refused_in_one_line_naming_the_holder(tmp_path):
    storage = ResultsStorage(str(tmp_path / "runs"), "sweep")
    with FolderLock(storage, "sweep 'sweep'"):
        held = (Path(storage.path) / LOCK_FILE).read_text()
        since = json.loads(held)["since"]
        with pytest.raises(DpivonError) as refused:
            FolderLock(storage, "sweep 'sweep'").acquire()
        line = str(refused.value)
        assert "\n" not in line
        assert line.startswith(f"sweep 'sweep' cannot start: {REFUSED} {storage.uri} ")
        assert f"(host {socket.gethostname()}, PID {os.getpid()}, since {since})" in line
        assert f"delete {storage.uri}/{LOCK_FILE} if that process is gone" in line
        assert (Path(storage.path) / LOCK_FILE).read_text() == held  # untouched
    assert not (Path(storage.path) / LOCK_FILE).exists()


def test_of_drivers_started_at_once_one_holds_the_folder(tmp_path):
    folder = tmp_path / "runs" / "sweep"
    processes, said, release = _holders(folder, 4)
    assert said.count("held") == 1, said
    holder = _holder_of(folder)["pid"]
    assert holder in [p.pid for p in processes]
    for line in said:
        assert (
            line == "held"
            or f"{REFUSED} {folder} (host {socket.gethostname()}, PID {holder}," in line
        )
    release.set()
    for process in processes:
        process.join(timeout=60)
    # the lock is gone; the folder too, unless a refused driver made it (then empty)
    assert not folder.exists() or list(folder.iterdir()) == []


def test_a_killed_holders_lock_is_taken_over_with_one_line(tmp_path, capsys):
    folder = tmp_path / "runs" / "sweep"
    (holder,), said, _ = _holders(folder, 1)
    assert said == ["held"]
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    assert _holder_of(folder)["pid"] == holder.pid  # SIGKILL left it

    with FolderLock(ResultsStorage.at(str(folder)), "sweep 'sweep'"):
        assert _holder_of(folder)["pid"] == os.getpid()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"took over {folder / LOCK_FILE} from PID {holder.pid} on this host" in line
    assert list(folder.iterdir()) == []  # the killed holder made the folder: it stays


def test_a_dead_holder_is_judged_on_its_own_host_only(tmp_path):
    storage = ResultsStorage(str(tmp_path / "runs"), "sweep")
    folder = Path(storage.path)
    folder.mkdir(parents=True)
    elsewhere = Holder("another-host", _ended_pid(), "2026-01-01T00:00:00+00:00", "t0")
    (folder / LOCK_FILE).write_text(elsewhere.text())
    with pytest.raises(DpivonError, match=r"\(host another-host, PID \d+, since 2026-01-01"):
        FolderLock(storage, "benchmark 'b'").acquire()
    assert (folder / LOCK_FILE).read_text() == elsewhere.text()  # never taken over

    (folder / LOCK_FILE).write_text("{half a record")
    with pytest.raises(DpivonError, match=f"lock file {folder / LOCK_FILE} is damaged"):
        FolderLock(storage, "benchmark 'b'").acquire()


@pytest.mark.parametrize("stop", [RuntimeError("boom"), KeyboardInterrupt()])
def test_the_lock_is_released_on_an_error_or_ctrl_c(tmp_path, stop):
    storage = ResultsStorage(str(tmp_path / "runs"), "sweep")
    with pytest.raises(type(stop)), FolderLock(storage, "sweep 'sweep'"):
        (Path(storage.path) / "sweep.json").write_text("{}")
        raise stop
    assert not (Path(storage.path) / LOCK_FILE).exists()
    with FolderLock(storage, "sweep 'sweep'"):  # free again
        pass


def _no_store_or_ray(monkeypatch, module) -> None:
    """The driver ``module`` fails the test if it opens MLflow or starts Ray."""

    def forbidden(*args, **kwargs):
        raise AssertionError("MLflow or Ray started by a refused driver")

    monkeypatch.setattr(module, "Tracker", forbidden)
    monkeypatch.setattr(module, "connect", forbidden)


def test_a_sweep_and_its_resume_are_refused_before_mlflow_and_ray(tmp_path, monkeypatch):
    from dpivon.search import sweep

    _no_store_or_ray(monkeypatch, sweep)
    path = write_pipeline(tmp_path)
    storage = load_pipeline(path).storage
    with FolderLock(storage, "another sweep"):
        for flags in ([], ["--resume"]):
            result = CliRunner().invoke(app, ["sweep", str(path), *flags])
            assert result.exit_code == 2, result.output
            assert REFUSED in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "mlflow.db").exists()
    assert not sweep_folder(load_pipeline(path)).exists()


@pytest.mark.parametrize("flags", [[], ["--resume"], ["--report-only"]])
def test_a_benchmark_is_refused_before_mlflow_and_ray(tmp_path, monkeypatch, flags):
    from dpivon.study import benchmark

    _no_store_or_ray(monkeypatch, benchmark)
    path = write_benchmark(tmp_path)
    with FolderLock(load_benchmark(Path(path)).storage, "another benchmark"):
        result = CliRunner().invoke(app, ["benchmark", path, *flags])
    assert result.exit_code == 2, result.output
    assert "benchmark 'tiny' cannot start" in result.output and REFUSED in result.output
    assert not (tmp_path / "mlflow.db").exists()


def test_on_an_object_store_a_second_driver_is_refused(s3, monkeypatch):
    monkeypatch.setattr(folder_lock, "SETTLE_S", 0.1)
    storage = ResultsStorage(f"s3://{s3.bucket}/runs", "sweep")
    with FolderLock(storage, "sweep 'sweep'"):
        assert "runs/sweep/.dpivon.lock" in s3.keys("runs/")
        with pytest.raises(DpivonError, match=f"PID {os.getpid()}, since"):
            FolderLock(storage, "sweep 'sweep'").acquire()
    assert not storage.exists(LOCK_FILE)
    # a gone holder's lock object is taken over
    gone = Holder(socket.gethostname(), _ended_pid(), "2026-01-01T00:00:00+00:00", "t0")
    storage.write_text(LOCK_FILE, gone.text())
    with FolderLock(storage, "sweep 'sweep'"):
        assert Holder.parse(storage.read_text(LOCK_FILE), "").pid == os.getpid()


def _tiny_sweep(tmp_path: Path, name: str) -> Path:
    """One trial of one epoch: seconds of training, a sweep's whole record."""
    return write_pipeline(
        tmp_path,
        name=name,
        trials=1,
        epochs=1,
        concurrency=1,
        scheduler={"type": "none"},
        optimizers=[DP_SGD],
    )


@pytest.mark.slow
def test_two_sweeps_started_at_once_on_one_folder(tmp_path, spawn):
    path = _tiny_sweep(tmp_path, "twice")
    pipeline = load_pipeline(path)
    # each its own MLflow store: the refused one must create none
    drivers = {
        which: spawn(
            [*DPIVON, "sweep", path, "--tracking-uri", f"sqlite:///{tmp_path}/{which}.db"], which
        )
        for which in ("a", "b")
    }
    for which, (driver, _) in drivers.items():
        wait_until(lambda d=driver: d.poll() is not None, 600, f"sweep {which}")
    codes = {which: driver.returncode for which, (driver, _) in drivers.items()}
    assert sorted(codes.values()) == [0, 2], {w: log.read_text() for w, (_, log) in drivers.items()}
    loser = next(which for which, code in codes.items() if code == 2)
    winner = next(which for which in codes if which != loser)

    lines = [line for line in drivers[loser][1].read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and REFUSED in lines[0], lines
    assert "sweep 'twice' cannot start" in lines[0]
    assert not (tmp_path / f"{loser}.db").exists()

    # the winner's record is whole: its parent, its trial under it, the trial in its table
    os.replace(tmp_path / f"{winner}.db", tmp_path / "mlflow.db")
    _, (parent,), (child,) = runs_of(tmp_path, pipeline.experiment)
    assert parent.info.status == "FINISHED" and child.info.status == "FINISHED"
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    table = (sweep_folder(pipeline) / "trials.csv").read_text().splitlines()
    assert len(table) == 2 and child.data.tags["dpivon.trial_id"] in table[1]
    assert not (sweep_folder(pipeline) / LOCK_FILE).exists()


@pytest.mark.slow
def test_a_resume_takes_over_the_folder_of_a_killed_driver(tmp_path, spawn):
    path = _tiny_sweep(tmp_path, "killed")
    pipeline = load_pipeline(path)
    folder = sweep_folder(pipeline)
    driver, _ = spawn([*DPIVON, "sweep", path], "driver")
    wait_until(lambda: (folder / "sweep.json").exists(), 300, "the sweep's start", driver)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver and its local Ray, as a dead machine
    driver.wait()
    killed_pid = _holder_of(folder)["pid"]
    assert killed_pid == driver.pid

    resumed, resumed_log = spawn([*DPIVON, "sweep", path, "--resume"], "resumed")
    wait_until(lambda: resumed.poll() is not None, 600, "the resumed sweep")
    output = resumed_log.read_text()
    assert resumed.returncode == 0, output[-3000:]
    assert f"took over {folder / LOCK_FILE} from PID {killed_pid} on this host" in output
    _, (parent,), (child,) = runs_of(tmp_path, pipeline.experiment)
    assert parent.info.status == "FINISHED" and child.info.status == "FINISHED"
    assert not (folder / LOCK_FILE).exists()
