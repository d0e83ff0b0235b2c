"""One driver per run folder: a sweep or a benchmark holds its folder
(``<storage_path>/<name>``) for its whole life, so that a second driver started on the same
folder is refused in one line before it opens MLflow or starts Ray. Without it both would
write the same state file and Tune experiment, and one's trials would end up under the
other's parent run.

The lock is the file ``.dpivon.lock`` in the folder, a JSON object naming its holder: host,
PID, when it took the folder, and a random token that tells its own lock from a later one.
A driver takes it on a new run and on ``--resume`` alike, and removes it on any exit that
runs Python's clean-up: a normal end, an error, Ctrl-C, SIGTERM once the driver's signal
handlers are set. A holder that died without it (SIGKILL, a crash, its machine rebooted)
leaves the file behind: a driver on the same host whose PID no longer runs is gone, and the
next driver takes its lock over, saying so in one line. A holder on another host is never
judged from here (its PID means nothing on this machine): the refusal names the file to
delete once that driver is known to be gone.

How the lock is made, by where the folder is:

- a local disk, or storage mounted by every node (NFS, a ReadWriteMany volume): the record
  is written whole to a file of its own, then hard-linked to the lock's name; ``link(2)``
  fails when the name exists, atomically on a local disk and on NFS alike (``open(2)``
  recommends it over ``O_CREAT | O_EXCL`` there), and a reader never sees half a record.
  Not ``fcntl``/``flock``: on NFS those depend on a lock daemon, are emulated or dropped
  silently by some servers and clients, and say nothing of who holds the folder.
- an object store (``s3://``, ``gs://``): best effort. The folder is written through
  pyarrow (as Ray Tune writes it), which has no conditional put (S3's ``If-None-Match: *``,
  GCS's ``ifGenerationMatch=0``). A driver writes the lock object only when there is none,
  then reads it back after :data:`SETTLE_S`: of two drivers whose writes fall within that
  time, the one whose write came last holds the folder and the other is refused. Two
  drivers whose check and write lie further apart than that (a store that slow) can both
  go on; start one driver per folder there.

A benchmark's ``--report-only`` takes the lock too: it writes the folder's report and logs
it, with the shift scores it completes, to the benchmark's MLflow runs, which a running
benchmark writes as well.

API::

    with FolderLock(pipeline.storage, f"sweep {pipeline.name!r}"):
        ...  # the driver's whole life: MLflow, Ray, trials, report
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType

from rich.console import Console

from dpivon.errors import DpivonError
from dpivon.orchestration.storage import ResultsStorage

__all__ = ["LOCK_FILE", "SETTLE_S", "FolderLock", "Holder"]

LOCK_FILE = ".dpivon.lock"
SETTLE_S = 2.0  # object stores: how long a driver waits before reading its lock back
# Takeovers and releases between a failed take and the read of the holder: tries in all
_TRIES = 3

console = Console(stderr=True)


@dataclass(frozen=True)
class Holder:
    """Who holds a folder: the record in its lock file."""

    host: str
    pid: int
    since: str  # UTC, ISO 8601 to the second
    token: str

    @classmethod
    def this_process(cls) -> Holder:
        now = datetime.now(UTC).isoformat(timespec="seconds")
        return cls(socket.gethostname(), os.getpid(), now, secrets.token_hex(8))

    @classmethod
    def parse(cls, text: str, where: str) -> Holder:
        try:
            record = json.loads(text)
            host, pid, since = str(record["host"]), int(record["pid"]), str(record["since"])
            return cls(host, pid, since, str(record["token"]))
        except (ValueError, TypeError, KeyError):
            raise DpivonError(
                f"the lock file {where} is damaged; delete it if no sweep or benchmark runs "
                "on this folder"
            ) from None

    def text(self) -> str:
        return json.dumps(asdict(self))

    def __str__(self) -> str:
        return f"host {self.host}, PID {self.pid}, since {self.since}"

    @property
    def gone(self) -> bool:
        """It ran on this host and its process has ended (another host's: never known)."""
        return self.host == socket.gethostname() and not _process_runs(self.pid)


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        # a killed process its parent has not reaped yet still answers signal 0
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux), or it ended meanwhile: the next take tells
    return state != "Z"


class FolderLock:
    """The exclusive hold of one driver on a run folder, for a ``with`` block (or between
    :meth:`acquire` and :meth:`release`); ``what`` names the driver in messages
    (``sweep 'smoke'``)."""

    def __init__(self, storage: ResultsStorage, what: str):
        self.storage, self.what = storage, what
        self.holder = Holder.this_process()
        self.where = storage.location(LOCK_FILE)
        self._made: list[Path] = []  # local folders the lock created, innermost last

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the folder, or raise one :class:`DpivonError` line naming its holder; a
        gone holder's lock is taken over with one line."""
        if self.storage.is_local:
            self._make_folder()
        try:
            for _ in range(_TRIES):
                if self._take():
                    return
                text = self._read()
                if text is None:  # released since
                    continue
                other = Holder.parse(text, self.where)
                if not other.gone:
                    raise DpivonError(
                        f"{self.what} cannot start: another driver holds {self.storage.uri} "
                        f"({other}); wait for it to end, or delete {self.where} if that "
                        "process is gone"
                    )
                console.print(
                    f"[yellow]note:[/] took over {self.where} from PID {other.pid} on this "
                    f"host (since {other.since}), which has ended",
                    highlight=False,
                    soft_wrap=True,
                )
                self._remove_stale(text)
            raise DpivonError(
                f"{self.what} cannot start: other drivers keep taking and leaving "
                f"{self.storage.uri}; start one driver per folder"
            )
        except BaseException:
            self._remove_made_folders()
            raise

    def release(self) -> None:
        """Give the folder up, if this driver still holds it (a lock deleted by hand, or
        taken over, stays as it is); folders the lock made and nothing else filled go too."""
        try:
            if self._read() == self.holder.text():
                self.storage.remove(LOCK_FILE)
        except DpivonError as err:  # the store unreachable at the end: say so, keep the error
            console.print(f"[yellow]warning:[/] {self.where} stays: {err}", highlight=False)
        self._remove_made_folders()

    def _make_folder(self) -> None:
        folder = Path(self.storage.path)
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        with self._errors("make"):
            folder.mkdir(parents=True, exist_ok=True)
        self._made = missing[::-1]

    def _remove_made_folders(self) -> None:
        # A driver refused before it wrote anything leaves no empty folder behind
        for folder in reversed(self._made):
            try:
                folder.rmdir()
            except OSError:  # it holds files now (or a later driver's lock)
                break
        self._made = []

    def _take(self) -> bool:
        """Whether this driver now holds the folder."""
        record = self.holder.text()
        if not self.storage.is_local:
            if self.storage.exists(LOCK_FILE):
                return False
            self.storage.write_text(LOCK_FILE, record)
            time.sleep(SETTLE_S)  # a rival's write within this time replaces ours: read it
            return self._read() == record
        lock = Path(self.storage.path) / LOCK_FILE
        mine = lock.with_name(f"{LOCK_FILE}.{self.holder.token}")
        with self._errors("write"):
            try:
                mine.write_text(record)
                with contextlib.suppress(FileExistsError):
                    os.link(mine, lock)
                # NFS may answer a retried link with EEXIST though the first one made it:
                # the link count says (open(2))
                return mine.stat().st_nlink == 2
            finally:
                mine.unlink(missing_ok=True)

    def _read(self) -> str | None:
        """The lock file's text; None when there is none."""
        if self.storage.is_local:
            with self._errors("read"), contextlib.suppress(FileNotFoundError):
                return (Path(self.storage.path) / LOCK_FILE).read_text()
            return None
        return self.storage.read_text(LOCK_FILE) if self.storage.exists(LOCK_FILE) else None

    def _remove_stale(self, stale: str) -> None:
        """Delete the gone holder's lock ``stale``, and no lock a rival took meanwhile."""
        if not self.storage.is_local:
            self.storage.remove(LOCK_FILE)  # best effort, as the take there
            return
        lock = Path(self.storage.path) / LOCK_FILE
        aside = lock.with_name(f"{LOCK_FILE}.{self.holder.token}.stale")
        with self._errors("take over"):
            try:
                os.rename(lock, aside)  # one driver of those taking over moves it
            except FileNotFoundError:
                return  # another one did
            try:
                if aside.read_text() != stale:  # a rival's fresh lock, taken since: back
                    with contextlib.suppress(FileExistsError):
                        os.link(aside, lock)
            finally:
                aside.unlink()

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except OSError as err:
            raise DpivonError(
                f"cannot {what} the lock file {self.where}: {err.strerror or err}"
            ) from None
