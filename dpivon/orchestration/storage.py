"""Where a sweep or benchmark keeps its files: a local folder or any URI that Ray Tune can
write.

Its folder is ``<storage_path>/<name>``. A sweep's holds the state file (``sweep.json``),
the Tune experiment (with the trials' checkpoints) and the final reports; a benchmark's its
state file (``benchmark.json``) and its report. All of
it goes through one pyarrow filesystem, the abstraction Ray Tune itself writes through, so
the driver, the trials on every node and ``dpivon export`` see the same files:

- a path (relative to the current directory, ``~`` expanded) or ``file:///abs/path``: the
  local disk. On a cluster of several machines it must be storage every node mounts at the
  same path (NFS, a ReadWriteMany volume): a trial restarted elsewhere restores from there.
- ``s3://bucket/prefix``: S3 or an S3-compatible server (MinIO, ...). The endpoint comes
  from ``AWS_ENDPOINT_URL`` or the URI's query
  (``s3://bucket/prefix?endpoint_override=minio:9000&scheme=http``); credentials from the
  usual AWS chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``~/.aws``, instance
  roles), which every Ray node needs as well. Never put them in the URI: it is shown,
  tagged and pickled with the Tune experiment.
- ``gs://bucket/prefix``: Google Cloud Storage (credentials as for any GCS client).

API (``name`` arguments are paths relative to the folder, ``/``-separated)::

    storage = ResultsStorage(pipeline.storage_path, pipeline.name)
    ResultsStorage.at("s3://bucket/prefix/quickstart")   # the same, from the folder itself
    storage.uri                       # the folder as a URI (a plain path when local): show it
    storage.is_local
    tune.RunConfig(name=experiment, storage_path=storage.path,
                   storage_filesystem=storage.filesystem)      # Tune's files in the folder
    tune.Tuner.can_restore(storage.experiment_path(experiment),
                           storage_filesystem=storage.filesystem)
    storage.exists("sweep.json"); storage.read_text("sweep.json")
    storage.write_text("sweep.json", text)     # atomic on a local disk (rename); an object
                                               # store's put is atomic by itself
    storage.write_bytes("pareto.png", data); storage.read_bytes(name); storage.listdir(name)
    storage.uri_of(trial.checkpoint.path)      # a path Tune reports, as a URI for MLflow/CSV
    with local_copy(uri) as path: ...          # a file or folder URI as a local path
                                               # (downloaded to a temporary folder if remote)

Every failure of the filesystem (unreachable endpoint, missing bucket, no credentials) is a
one-line :class:`~dpivon.errors.DpivonError` naming the URI.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow.fs as pafs

from dpivon.errors import DpivonError, first_line
from dpivon.paths import check_writable_folder, redact_uri

__all__ = ["ResultsStorage", "local_copy", "open_uri"]

STORE_ANSWER_S = 1  # retries of the HEAD that checks an object store answers, in seconds


def _is_uri(location: str) -> bool:
    return "://" in location


def open_uri(location: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path on it) of a local path or a URI, as Ray resolves it."""
    if not _is_uri(location):
        return pafs.LocalFileSystem(), str(Path(location).expanduser().resolve())
    try:
        return pafs.FileSystem.from_uri(location)
    except (OSError, ValueError) as err:
        raise DpivonError(f"cannot open storage {redact_uri(location)}: {_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    # pyarrow's errors carry the AWS SDK's multi-line detail, and Google's a paragraph on
    # one line: the first sentence of the first line says it.
    return first_line(err, 2000).split(". ")[0]


class ResultsStorage:
    """The folder ``<storage_path>/<name>`` of one sweep (or benchmark), on whatever
    filesystem it is."""

    def __init__(self, storage_path: str, name: str):
        self.storage_path, self.name = storage_path, name
        root = storage_path.rstrip("/")
        if _is_uri(root):
            parts = urllib.parse.urlsplit(root)
            if parts.password is not None:
                # the URI is shown, tagged and pickled into Tune's experiment state
                raise DpivonError(
                    f"storage_path {redact_uri(root)} holds credentials: give them in the "
                    "environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) instead"
                )
            # the sweep folder inside the URI's path, the query (endpoint options) kept
            location = urllib.parse.urlunsplit(parts._replace(path=f"{parts.path}/{name}"))
            self._scheme, self._query = parts.scheme, parts.query
        else:
            location = str(Path(root).expanduser().resolve() / name)
            self._scheme, self._query = "", ""
        self.filesystem, self.path = open_uri(location)
        self.is_local = isinstance(self.filesystem, pafs.LocalFileSystem)

    @classmethod
    def at(cls, location: str) -> ResultsStorage:
        """The sweep whose folder is ``location`` itself (a path or a URI)."""
        if not _is_uri(location):
            folder = Path(location).expanduser().resolve()
            return cls(str(folder.parent), folder.name)
        parts = urllib.parse.urlsplit(location.rstrip("/"))
        parent, _, name = parts.path.rpartition("/")
        return cls(urllib.parse.urlunsplit(parts._replace(path=parent)), name)

    def __reduce__(self):
        # Pickled with Tune callbacks: rebuilt from its inputs, not from a live client.
        return (ResultsStorage, (self.storage_path, self.name))

    def __repr__(self) -> str:
        return f"ResultsStorage({self.uri!r})"

    @property
    def uri(self) -> str:
        """The sweep folder: an absolute path when local, else a URI."""
        return self.uri_of(self.path)

    def uri_of(self, fs_path: str) -> str:
        """A path on this storage's filesystem (as Tune reports checkpoints) as a location
        that :func:`open_uri` and :func:`local_copy` open again, with the same options."""
        if self.is_local or not self._scheme:
            return fs_path
        query = f"?{self._query}" if self._query else ""
        return f"{self._scheme}://{fs_path.lstrip('/')}{query}"

    def location(self, name: str) -> str:
        """Where the file ``name`` of the folder is, to show or record: a local path, or a
        URI with the folder's options."""
        return self.uri_of(self._full(name))

    def name_of(self, location: str, recorded_at: str | None = None) -> str:
        """The name of a file of this folder from its location (the inverse of
        :meth:`location`): a record that names it so still finds it once the folder is
        copied, downloaded or committed elsewhere. ``recorded_at``: where the folder was
        when the location was recorded (a copied folder's older records point there)."""
        _, path = open_uri(location)
        folders = [self.path] + ([open_uri(recorded_at)[1]] if recorded_at else [])
        for folder in folders:
            try:
                return PurePosixPath(path).relative_to(folder).as_posix()
            except ValueError:
                continue
        raise DpivonError(f"{redact_uri(location)} is not in {redact_uri(self.uri)}")

    def experiment_path(self, experiment: str) -> str:
        """The path of a Tune experiment (``RunConfig(name=experiment)``) on
        :attr:`filesystem`, for ``Tuner.can_restore`` / ``Tuner.restore``."""
        return self._full(experiment)

    def _full(self, name: str) -> str:
        return f"{self.path}/{name}" if name else self.path

    @contextmanager
    def _errors(self, what: str, name: str) -> Iterator[None]:
        try:
            yield
        except OSError as err:
            raise DpivonError(f"cannot {what} {self.location(name)}: {_one_line(err)}") from None

    def check_writable(self) -> None:
        """A local sweep folder can be made and written (checked without creating it); an
        object store answers, within seconds (whether it lets us write, only the sweep's
        first write tells)."""
        if self.is_local:
            check_writable_folder(Path(self.path), "storage_path")
            return
        filesystem = self.filesystem
        if self._scheme == "gs":
            # GCS retries for 15 minutes, and without credentials it waits on a metadata
            # server that is not there: a bounded retry policy for this one question.
            parts = urllib.parse.urlsplit(self.uri)
            query = dict(urllib.parse.parse_qsl(parts.query))
            query.setdefault("retry_limit_seconds", str(STORE_ANSWER_S))
            filesystem, _ = open_uri(
                urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))
            )
        with self._errors("reach", ""):
            filesystem.get_file_info(self.path)

    def exists(self, name: str = "") -> bool:
        with self._errors("check", name):
            info = self.filesystem.get_file_info(self._full(name))
        return info.type != pafs.FileType.NotFound

    def read_bytes(self, name: str) -> bytes:
        with self._errors("read", name), self.filesystem.open_input_stream(self._full(name)) as f:
            return f.read()

    def read_text(self, name: str) -> str:
        data = self.read_bytes(name)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DpivonError(f"{self.location(name)} is no UTF-8 text: {err}") from None

    def read_json(self, name: str) -> dict[str, Any]:
        """A JSON object this sweep wrote; one line naming the file when it is damaged."""
        where = self.location(name)
        try:
            value = json.loads(self.read_text(name))
        except json.JSONDecodeError as err:
            raise DpivonError(
                f"{where} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
                "a damaged or half-written sweep file: restore it or start the sweep anew"
            ) from None
        if not isinstance(value, dict):
            raise DpivonError(f"{where} holds no JSON object; a damaged sweep file")
        return value

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write one file; on a local disk through a temporary file and a rename, so a
        reader (or a driver killed mid-write) never sees half a state file."""
        target = self._full(name)
        with self._errors("write", name):
            if self.is_local:
                Path(target).parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=Path(target).parent, prefix=".tmp-")
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    os.replace(tmp, target)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
            else:
                with self.filesystem.open_output_stream(target) as f:
                    f.write(data)

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode("utf-8"))

    def remove(self, name: str) -> None:
        """Delete one file; nothing when it is missing."""
        with self._errors("delete", name):
            if self.exists(name):
                self.filesystem.delete_file(self._full(name))

    def files_named(self, folder: str, filename: str) -> list[str]:
        """Every file called ``filename`` anywhere under ``folder``, as names in this storage."""
        selector = pafs.FileSelector(self._full(folder), allow_not_found=True, recursive=True)
        with self._errors("list", folder):
            infos = self.filesystem.get_file_info(selector)
        root = self._full("")
        return sorted(
            info.path.removeprefix(root).lstrip("/")
            for info in infos
            if info.type == pafs.FileType.File and info.base_name == filename
        )

    def remove_files_named(self, folder: str, filename: str) -> int:
        """Delete every file called ``filename`` anywhere under ``folder``; how many."""
        found = self.files_named(folder, filename)
        with self._errors("clean", folder):
            for name in found:
                self.filesystem.delete_file(self._full(name))
        return len(found)

    def listdir(self, name: str = "") -> list[str]:
        """Names of the entries directly in ``name`` (sorted; empty when it is missing)."""
        selector = pafs.FileSelector(self._full(name), allow_not_found=True)
        with self._errors("list", name):
            infos = self.filesystem.get_file_info(selector)
        return sorted(info.base_name for info in infos)


# The name under which sweeps started before the rename pickled it in Tune's state: their
# `--resume` unpickles it by this name.
SweepStorage = ResultsStorage


@contextmanager
def local_copy(location: str) -> Iterator[Path]:
    """A file or folder (local path or URI, e.g. a trial checkpoint) as a local path: the
    path itself when local, else a copy in a temporary folder removed afterwards."""
    filesystem, path = open_uri(location)
    if isinstance(filesystem, pafs.LocalFileSystem):
        if not Path(path).exists():
            raise DpivonError(f"not found: {path}")
        yield Path(path)
        return
    shown = redact_uri(location)
    try:
        info = filesystem.get_file_info(path)
    except OSError as err:
        raise DpivonError(f"cannot read {shown}: {_one_line(err)}") from None
    if info.type == pafs.FileType.NotFound:
        raise DpivonError(f"not found: {shown}")
    with tempfile.TemporaryDirectory(prefix="dpivon-") as tmp:
        target = Path(tmp) / info.base_name
        if info.type == pafs.FileType.Directory:
            target.mkdir()  # pyarrow creates the folders inside it, not the folder itself
        try:
            pafs.copy_files(
                path,
                str(target),
                source_filesystem=filesystem,
                destination_filesystem=pafs.LocalFileSystem(),
            )
        except OSError as err:
            raise DpivonError(f"cannot download {shown}: {_one_line(err)}") from None
        yield target
