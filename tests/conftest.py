"""Real services for the tests, each on a free loopback port and torn down with deadlines.

- ``pg``: one PostgreSQL 15 cluster for the session (``postgres``: a fresh database in it)
- ``s3``: a bucket of its own on an S3-compatible server (moto's server mode), with the
  AWS variables set for this process and returned for subprocesses
- ``mlflow_servers``: starts ``mlflow server`` processes, which a test may stop and start
- ``ray_cluster``: a Ray cluster of ``ray start`` processes (a head, workers to add and
  kill), with token authentication as on a real cluster
- ``spawn``: any other process (a ``dpivon sweep`` driver), ended at teardown
- ``own_cache``: DPIVON_CACHE in the test's folder (before ``fresh_local_ray``, so that Ray's
  workers see it too)
- ``fresh_local_ray``: a local Ray of 2 CPUs started for one test, after the environment the
  test set (its workers inherit it), whatever Ray an earlier test left in this process

Two tiers, marked here by what a test uses (`pytest_collection_modifyitems`), so that a new
test lands in its tier without a decorator: the integration tier (marker ``integration``)
holds every test that starts Ray or a service process, runs a whole sweep or benchmark, or
draws the generated fuzz corpus; the rest is the unit tier, `make test-fast` (with
``not slow``). `make test` runs both.

Processes run in sessions of their own and are ended by their process group, never by
name: other Ray clusters on the same machine are not touched.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import pytest
import torch

PG_BIN = Path("/usr/lib/postgresql/15/bin")
# The shared CIFAR-10 copy: $DPIVON_DATA (.ci/run sets it), else beside the checkout.
CIFAR10_TARBALL = Path(
    os.environ.get("DPIVON_DATA")
    or Path(__file__).resolve().parents[2] / "shared/data/cifar10-jpeg.tar.gz"
)
BIN = Path(sys.executable).parent
_names = itertools.count()
_gone = contextlib.suppress(ProcessLookupError)  # the process group has already exited


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(
    check: Callable[[], bool], timeout_s: float, what: str, process: subprocess.Popen | None = None
) -> None:
    """Poll ``check`` until it holds; fail the test in one line at the deadline or when
    ``process`` (the thing waited for) has exited."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if process is not None and process.poll() is not None:
            pytest.fail(f"{what}: the process exited with {process.returncode}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.5)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def start_process(args: list, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A service process in its own session (so its group can be ended), logging to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [str(a) for a in args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def session_members(session: int) -> list[int]:
    """Every process of a session (a process started here leads its own): Ray's workers
    put themselves in groups of their own, but stay in the session."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[3]) == session:  # after the name: state, ppid, pgrp, session
            members.append(int(stat.parent.name))
    return members


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL the process and everything it started, as when its machine dies."""
    for pid in session_members(process.pid):
        with _gone:
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)


def stop_processes(processes: list[subprocess.Popen], timeout_s: float = 15) -> None:
    """SIGTERM the processes' groups together, SIGKILL what is left of their sessions after
    ``timeout_s``."""
    for process in processes:
        with _gone:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        kill_session(process)


@pytest.fixture
def one_thread():
    """Tiny models: one thread avoids the thread-pool overhead that dominates them; the
    later tests get the count back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def spawn(tmp_path) -> Iterator[Callable[..., tuple[subprocess.Popen, Path]]]:
    """``spawn(args, name, env={})``: a process in its own session (with everything it
    starts, e.g. a local Ray) and its log (stdout and stderr); ended at teardown."""
    started: list[subprocess.Popen] = []

    def start(
        args: list, name: str, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"{name}.log"
        started.append(start_process(args, log, {**os.environ, **(env or {})}))
        return started[-1], log

    try:
        yield start
    finally:
        stop_processes(started[::-1])


# --- PostgreSQL ------------------------------------------------------------------------


@dataclass
class Postgres:
    port: int
    _template: str | None = None

    def uri(self, database: str) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{database}"

    def _createdb(self, name: str, *options: str) -> None:
        subprocess.run(
            [
                PG_BIN / "createdb",
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                *options,
                name,
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def new_database(self) -> str:
        """A database with MLflow's tables: copied from a template that MLflow set up once
        (its migrations take most of a minute on a busy machine)."""
        if self._template is None:
            self._createdb("mlflow_template")
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys; from mlflow.store.tracking."
                    "sqlalchemy_store import SqlAlchemyStore as S; S(sys.argv[1], '/')",
                    self.uri("mlflow_template"),
                ],
                check=True,
                capture_output=True,
                timeout=300,
            )
            self._template = "mlflow_template"
        name = f"db{next(_names)}"
        self._createdb(name, "-T", self._template)
        return self.uri(name)


@pytest.fixture(scope="session")
def pg() -> Iterator[Postgres]:
    """A throw-away PostgreSQL 15 cluster on a free loopback port (runs as user postgres)."""
    if not (PG_BIN / "initdb").exists():
        pytest.fail(
            f"PostgreSQL 15 is needed for this test ({PG_BIN}): apt-get install postgresql-15"
        )
    data = Path(tempfile.mkdtemp(prefix="dpivon-pg-"))
    shutil.chown(data, "postgres", "postgres")
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    port = free_port()
    subprocess.run(
        [*as_postgres, PG_BIN / "initdb", "-D", data / "db", "-A", "trust", "-U", "postgres"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    subprocess.run(
        [
            *as_postgres,
            PG_BIN / "pg_ctl",
            "-D",
            data / "db",
            "-w",
            "-t",
            "60",
            "-l",
            data / "log",
            "-o",
            f"-p {port} -k {data} -c listen_addresses=127.0.0.1",
            "start",
        ],
        check=True,
        capture_output=True,
        timeout=90,
    )
    try:
        yield Postgres(port)
    finally:
        subprocess.run(
            [*as_postgres, PG_BIN / "pg_ctl", "-D", data / "db", "-m", "fast", "-t", "60", "stop"],
            capture_output=True,
            timeout=90,
        )
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def postgres(pg: Postgres) -> str:
    """The URI of a fresh database (MLflow servers of different tests never share one)."""
    return pg.new_database()


# --- S3 ------------------------------------------------------------------------------


@dataclass
class S3:
    endpoint: str
    bucket: str
    # what a process needs to reach the bucket: pyarrow and boto3 read AWS_ENDPOINT_URL,
    # MLflow's S3 artifact store MLFLOW_S3_ENDPOINT_URL
    env: dict[str, str] = field(default_factory=dict)

    def keys(self, prefix: str = "") -> list[str]:
        client = boto3.client("s3", endpoint_url=self.endpoint)
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory) -> Iterator[str]:
    """moto's S3 server in a process of its own on a free loopback port."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = start_process([BIN / "moto_server", "-H", "127.0.0.1", "-p", port], log)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(f"{endpoint}/moto-api/"), 60, "the S3 server", server)
        yield endpoint
    finally:
        stop_processes([server])


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch) -> S3:
    """A new bucket; this process's AWS settings point at it (credentials are dummies)."""
    env = {
        "AWS_ACCESS_KEY_ID": "dpivon-test",
        "AWS_SECRET_ACCESS_KEY": "dpivon-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_endpoint,
        "MLFLOW_S3_ENDPOINT_URL": s3_endpoint,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    bucket = f"dpivon-{next(_names)}-{secrets.token_hex(4)}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    return S3(s3_endpoint, bucket, env)


# --- MLflow --------------------------------------------------------------------------


class MlflowServer:
    """``mlflow server`` on a fixed free port: stop() and start() again keep its URI."""

    def __init__(self, backend: str, artifacts: str, log: Path, env: dict[str, str]):
        self.port, self.log, self.env = free_port(), log, env
        self.args = [
            BIN / "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            self.port,
            "--backend-store-uri",
            backend,
            "--artifacts-destination",
            artifacts,
            "--workers",
            "1",
        ]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = start_process(self.args, self.log, {**os.environ, **self.env})
        wait_until(lambda: answers(f"{self.uri}/health"), 120, "the MLflow server", self.process)

    def stop(self) -> None:
        if self.process is not None:
            stop_processes([self.process], timeout_s=10)
            self.process = None


@pytest.fixture
def mlflow_servers(tmp_path_factory) -> Iterator[Callable[..., MlflowServer]]:
    """``start(backend_uri, artifacts_destination, env={})``: a started server."""
    servers: list[MlflowServer] = []

    def start(backend: str, artifacts: str, env: dict[str, str] | None = None) -> MlflowServer:
        log = tmp_path_factory.mktemp("mlflow") / "server.log"
        server = MlflowServer(backend, artifacts, log, env or {})
        servers.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


# --- Ray -----------------------------------------------------------------------------


@dataclass
class RayNode:
    process: subprocess.Popen
    node_id: str  # what ray.get_runtime_context().get_node_id() says on it


class RayCluster:
    """A head and worker nodes as ``ray start --block`` processes, token authentication on.

    Ray turns 127.0.0.1 into the machine's own address (its nodes must reach each other),
    so its ports listen beyond loopback: the token guards them.
    """

    def __init__(self, directory: Path):
        # short: Ray's socket paths under it must fit the 107-byte limit
        self.temp_dir = Path(tempfile.mkdtemp(prefix="dpr-", dir="/tmp"))
        self.logs = directory
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.processes: list[subprocess.Popen] = []

    def node_ids(self) -> set[str]:
        """The alive nodes, from `ray status` (empty while the head does not answer)."""
        status = subprocess.run(
            [BIN / "ray", "status", "--address", self.address],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **self.env},
        )
        active = status.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
        return set(re.findall(r"node_([0-9a-f]+)", active)) if status.returncode == 0 else set()

    def _start(self, name: str, args: list, env: dict[str, str] | None) -> RayNode:
        before = self.node_ids() if self.processes else set()
        # every port a node opens is chosen here: the defaults (52365, ...) would collide
        # with other Ray clusters on the machine
        ports = [
            f"--{flag}={free_port()}"
            for flag in (
                "dashboard-agent-listen-port",
                "dashboard-agent-grpc-port",
                "runtime-env-agent-port",
                "metrics-export-port",
                "node-manager-port",
                "object-manager-port",
            )
        ]
        process = start_process(
            [BIN / "ray", "start", "--block", "--disable-usage-stats", *ports, *args],
            self.logs / f"{name}.log",
            {**os.environ, **self.env, **(env or {})},
        )
        self.processes.append(process)
        new: set[str] = set()

        def joined() -> bool:
            new.update(self.node_ids() - before)
            return bool(new)

        wait_until(joined, 120, f"the Ray {name} node", process)
        return RayNode(process, new.pop())

    def start_head(self, num_cpus: int, env: dict[str, str] | None = None) -> RayNode:
        return self._start(
            "head",
            [
                "--head",
                f"--port={self.port}",
                f"--num-cpus={num_cpus}",
                "--include-dashboard=false",
                f"--temp-dir={self.temp_dir}",
            ],
            env,
        )

    def add_worker(self, num_cpus: int, env: dict[str, str] | None = None) -> RayNode:
        return self._start(
            f"worker{len(self.processes)}",
            [f"--address={self.address}", f"--num-cpus={num_cpus}"],
            env,
        )

    def kill(self, node: RayNode) -> None:
        """The node dies at once, as when its machine fails; returns once the cluster has
        marked it dead."""
        kill_session(node.process)
        wait_until(lambda: node.node_id not in self.node_ids(), 120, "the node marked dead")

    def shutdown(self) -> None:
        # a node asked to stop drains for 30 s first; nothing here needs that
        stop_processes(self.processes[::-1], timeout_s=5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture
def ray_cluster(tmp_path_factory) -> Iterator[RayCluster]:
    """A Ray cluster to start nodes in (``start_head``, ``add_worker``, ``kill``)."""
    cluster = RayCluster(tmp_path_factory.mktemp("ray"))
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DPIVON_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fresh_local_ray() -> Iterator[None]:
    import ray

    ray.shutdown()  # one left by an in-process command (init_ray joins, never ends, it)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


# The integration tier: modules that are sweeps, clusters, servers or the fuzz corpus
# throughout, and the fixtures that start Ray, a service or a whole benchmark.
INTEGRATION_MODULES = frozenset({
    "test_sweep", "test_sweep_resilience", "test_faults", "test_topology", "test_storage",
    "test_tracking_server", "test_serving", "test_from_sweep", "test_fuzz", "test_readme",
    "test_quiet_output",
})  # fmt: skip
INTEGRATION_FIXTURES = frozenset({
    "spawn", "pg", "postgres", "s3", "s3_endpoint", "mlflow_servers", "ray_cluster",
    "fresh_local_ray", "finished_benchmark",
})  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in INTEGRATION_MODULES or INTEGRATION_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.integration)
