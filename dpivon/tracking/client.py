"""The MLflow client: runs, params, metrics, tags and artifacts, by explicit run id.

Everything goes through one `Tracker`, so the sweep driver can log many child runs from one
process (SQLite tolerates one writer) and the CLI one run. It never sets MLflow's global
tracking URI: each Tracker talks to its own store. The default store is MLflow's own:
``sqlite:///mlflow.db`` in the working directory.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow
import numpy as np
from mlflow.entities import LoggedModelStatus, Metric, Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from dpivon.errors import DpivonError, first_line
from dpivon.paths import check_regular_file, check_writable, redact_uri
from dpivon.tracking.layout import ERROR_LIMIT, ERROR_TAG

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_EXPERIMENT = "dpivon"
_MAX_BATCH = 100  # MLflow's limit of params / metrics per log_batch call
_PAGE = 1000  # runs per MLflow search page


def resolve_tracking_uri(uri: str | None) -> str:
    """Explicit URI, else MLFLOW_TRACKING_URI, else a SQLite file in the working directory;
    one that is no URI (``https://[::1``) is refused here, naming where it came from."""
    source = "--tracking-uri (or a run file's tracking_uri:)"
    if not uri and os.environ.get("MLFLOW_TRACKING_URI"):
        uri, source = os.environ["MLFLOW_TRACKING_URI"], "$MLFLOW_TRACKING_URI"
    uri = uri or DEFAULT_TRACKING_URI
    try:
        urllib.parse.urlsplit(uri)
    except ValueError as err:  # MLflow and redact_uri would fail later on it, unnamed
        raise DpivonError(f"{source} {uri!r} is not a valid URI: {err}") from None
    return uri


def check_tracking_server(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with one line, when an HTTP tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
            pass
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise DpivonError(
            f"cannot reach the MLflow tracking server at {redact_uri(uri)} ({reason}); start it "
            "(mlflow server ...) or track to a local store (--tracking-uri sqlite:///mlflow.db)"
        ) from None


def check_sqlite_store(uri: str) -> None:
    """Fail fast, with one line, when a ``sqlite:///`` store's file cannot be written (a
    directory, a FIFO, /proc): MLflow would retry for two minutes, then raise its own error."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri.removeprefix("sqlite:///").partition("?")[0])
    what = f"the SQLite file of the tracking URI {redact_uri(uri)}:"
    if os.path.lexists(path):
        check_regular_file(path, what)
    check_writable(path, what)


def check_store_exists(uri: str, why: str) -> None:
    """One line where a ``sqlite:///`` store that should hold earlier runs does not exist:
    MLflow would create an empty one and answer that the runs are missing."""
    path = Path(uri.removeprefix("sqlite:///").partition("?")[0])
    if uri.startswith("sqlite:///") and not path.exists():
        raise DpivonError(f"the tracking store {redact_uri(uri)} does not exist; {why}")


@contextmanager
def fluent_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent calls (``mlflow.pyfunc.log_model``, ``load_model`` of a ``runs:/``
    URI) take no tracking URI but read the global one: it is ``uri`` for their duration
    only, then what it was."""
    previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)


def _artifact_location(tracking_uri: str) -> str | None:
    """Artifacts of a SQLite store go beside the database file (MLflow's own default is
    ./mlruns of whatever directory the process runs in); a server decides for itself."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    database = Path(tracking_uri.removeprefix("sqlite:///")).resolve()
    return (database.parent / "mlartifacts").as_uri()


class Tracker:
    """A thin, explicit-run-id layer over MlflowClient."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = DEFAULT_EXPERIMENT):
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        check_tracking_server(self.tracking_uri)
        check_sqlite_store(self.tracking_uri)
        self.display_uri = redact_uri(self.tracking_uri)
        self.experiment_name = experiment
        try:
            self.client = MlflowClient(self.tracking_uri)
            existing = self.client.get_experiment_by_name(experiment)
            self.experiment_id = (
                existing.experiment_id
                if existing
                else self.client.create_experiment(
                    experiment, _artifact_location(self.tracking_uri)
                )
            )
        except (MlflowException, ImportError, OSError) as err:  # a store MLflow cannot use
            raise DpivonError(
                f"cannot use the tracking URI {self.display_uri}: {first_line(err)} (use "
                "sqlite:///mlflow.db, a file path, or http(s)://host:port of an MLflow server)"
            ) from None

    def start_run(
        self, run_name: str, *, parent_run_id: str | None = None, tags: Mapping[str, str] = ()
    ) -> str:
        all_tags = dict(tags)
        if parent_run_id is not None:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        return run.info.run_id

    @contextmanager
    def run(
        self,
        run_name: str,
        *,
        parent_run_id: str | None = None,
        tags: Mapping[str, str] = (),
        run_id: str | None = None,
    ) -> Iterator[str]:
        """A run that ends FINISHED, or FAILED (KILLED on Ctrl-C): never left RUNNING.
        With ``run_id``, that existing run (a resumed sweep's parent) runs again."""
        if run_id is None:
            run_id = self.start_run(run_name, parent_run_id=parent_run_id, tags=tags)
        else:
            self.set_run_status(run_id, "RUNNING")
        try:
            yield run_id
        except KeyboardInterrupt:
            self.end_run(run_id, "KILLED")
            raise
        except BaseException as err:
            if self.reachable():  # a store that is down would stall each write for minutes
                self.set_tags(run_id, {ERROR_TAG: f"{type(err).__name__}: {err}"[:ERROR_LIMIT]})
                self.end_run(run_id, "FAILED")
            raise
        self.end_run(run_id, "FINISHED")

    def reachable(self) -> bool:
        """False when an HTTP tracking server does not answer its health check."""
        try:
            check_tracking_server(self.tracking_uri)
        except DpivonError:
            return False
        return True

    def end_run(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=status)

    def set_run_status(self, run_id: str, status: str) -> None:
        """Set the status alone (``RUNNING``: a resumed run), its end time untouched."""
        self.client.update_run(run_id, status=status)

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        items = [Param(k, _param_value(v)) for k, v in params.items()]
        for start in range(0, len(items), _MAX_BATCH):
            self.client.log_batch(run_id, params=items[start : start + _MAX_BATCH])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
        now = int(time.time() * 1000)
        items = [
            Metric(k, float(v), now, step)
            for k, v in metrics.items()
            if isinstance(v, int | float) and np.isfinite(v)
        ]
        for start in range(0, len(items), _MAX_BATCH):
            self.client.log_batch(run_id, metrics=items[start : start + _MAX_BATCH])

    def log_changed_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
        """Only the metrics whose latest value on the run differs, or that it lacks: logging
        the same conclusions again (a resumed finished sweep) adds nothing to their history.
        One the run holds that is now undefined (NaN) is logged as NaN: no stale value stands
        for it."""
        recorded = self.client.get_run(run_id).data.metrics

        def same(old: float | None, new: float) -> bool:
            return old == new or (old is not None and math.isnan(old) and math.isnan(new))

        changed = {k: v for k, v in metrics.items() if not same(recorded.get(k), v)}
        self.log_metrics(run_id, changed, step)
        undefined = [k for k, v in changed.items() if math.isnan(v) and k in recorded]
        if undefined:
            now = int(time.time() * 1000)
            nans = [Metric(k, math.nan, now, step) for k in undefined]
            self.client.log_batch(run_id, metrics=nans)

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_figure(self, run_id: str, figure: Figure, artifact_file: str) -> None:
        self.client.log_figure(run_id, figure, artifact_file)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def log_dict(self, run_id: str, data: Mapping, artifact_file: str) -> None:
        self.client.log_dict(run_id, dict(data), artifact_file)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def load_dict(self, run_id: str, artifact_file: str) -> dict[str, Any] | None:
        """What :meth:`log_dict` logged as ``artifact_file`` on the run (None: nothing)."""
        logged = {a.path for a in self.client.list_artifacts(run_id)}
        if artifact_file not in logged:
            return None
        with tempfile.TemporaryDirectory(prefix="dpivon-artifact-") as tmp:
            local = self.client.download_artifacts(run_id, artifact_file, tmp)
            return json.loads(Path(local).read_text())

    def run_tags(self, run_id: str) -> dict[str, str]:
        return dict(self.client.get_run(run_id).data.tags)

    def run_status(self, run_id: str) -> str:
        return self.client.get_run(run_id).info.status

    def child_runs(self, parent_run_id: str) -> list[Run]:
        """Every child run of the parent run, all pages of the query (a sweep's trials, a
        benchmark's runs: there may be more than one page of them)."""
        runs: list[Run] = []
        token = None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
                max_results=_PAGE,
                page_token=token,
            )
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def child_runs_by_tag(self, parent_run_id: str, tag: str) -> dict[str, Run]:
        """The child runs that carry ``tag``, by its value (a trial id, a run key)."""
        runs = self.child_runs(parent_run_id)
        return {run.data.tags[tag]: run for run in runs if tag in run.data.tags}

    def metric_history(self, run_id: str, key: str) -> list[Metric]:
        """Every value logged of one metric on the run, by step."""
        return sorted(self.client.get_metric_history(run_id, key), key=lambda m: m.step)

    def has_logged_model(self, run_id: str) -> bool:
        """Whether the run has a model logged in full (a resume logs a missing one only)."""
        models = self.client.search_logged_models(
            [self.experiment_id], filter_string=f"source_run_id = '{run_id}'"
        )
        return any(m.status == LoggedModelStatus.READY for m in models)

    def has_run(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False
        return True


def _param_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list | tuple) else str(value)
