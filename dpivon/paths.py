"""Files the user names, checked before anything is read, opened or written.

An input file must be a regular file (`check_regular_file`: never a FIFO or device, whose
open would block) of at most :data:`MAX_INPUT_BYTES` (a config is a few KB; a bigger one
is a mistake, and parsing it would take minutes). An output path must be
writable: not a directory, not under a regular file, in a folder we may write to; checked
without leaving anything behind (a probe file in the nearest existing folder is removed at
once), so a refusal leaves the disk as it was. Standard input is the one stream read where
a file may be (`read_input_text`: ``-`` or /dev/stdin, through a pipe).
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
import urllib.parse
from pathlib import Path

from dpivon.errors import DpivonError

MAX_INPUT_BYTES = 1 << 20  # 1 MiB: the largest shipped file is 4 KB


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "no regular file"


def _probe(folder: Path) -> None:
    """Write in ``folder`` for real (root passes every permission check, /proc refuses
    writes that access() allows); the probe file is gone when this returns."""
    with tempfile.TemporaryFile(dir=folder):
        pass


def check_regular_file(path: Path, what: str = "file") -> os.stat_result:
    """``path`` is a regular file, else one DpivonError line saying what it is. Only stat
    is called: opening a FIFO (or a tty, a device) would block until a writer comes."""
    try:
        info = Path(path).stat()
    except FileNotFoundError:
        raise DpivonError(f"{what} not found: {path}") from None
    except OSError as err:  # a symlink loop, no permission, a name too long
        raise DpivonError(f"cannot read {what} {path}: {err.strerror or err}") from None
    if not stat.S_ISREG(info.st_mode):
        raise DpivonError(f"{what} {path} is {_kind(info.st_mode)}, not a regular file")
    return info


def check_input_file(path: Path, what: str = "file") -> None:
    """``path`` is a regular file small enough to parse; else one DpivonError line."""
    info = check_regular_file(path, what)
    if info.st_size > MAX_INPUT_BYTES:
        raise DpivonError(
            f"{what} {path} is {info.st_size:,} bytes, above the limit of "
            f"{MAX_INPUT_BYTES:,} bytes (1 MiB) for an input file; is it the right file?"
        )


# The names that mean standard input (`--config -`, or /dev/stdin through a pipe)
STDIN_NAMES = frozenset({"-", "/dev/stdin"})


def read_input_text(path: Path, what: str = "file") -> str:
    """The UTF-8 text of input file ``path`` (`check_input_file`), or of standard input
    where ``path`` names it (read to its end, as large as a file may be)."""
    if str(path) not in STDIN_NAMES:
        check_input_file(path, what)
        try:
            return path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError) as err:
            raise DpivonError(f"cannot read {path} as UTF-8 text: {err}") from None
    if sys.stdin is None or sys.stdin.isatty():
        raise DpivonError(
            f"{what} {path} is standard input, which is a terminal here: pipe the {what} in "
            f"(cat run.yaml | dpivon train --config -) or name its file"
        )
    try:
        text = sys.stdin.read(MAX_INPUT_BYTES + 1)
    except (UnicodeDecodeError, OSError) as err:
        raise DpivonError(f"cannot read {what} {path} as UTF-8 text: {err}") from None
    if len(text) > MAX_INPUT_BYTES:
        raise DpivonError(
            f"{what} on standard input is above the limit of {MAX_INPUT_BYTES:,} bytes (1 MiB) "
            "for an input file; is it the right file?"
        )
    return text


def check_writable(path: Path, what: str) -> None:
    """A file can be written at ``path`` (creating missing folders); nothing is created.

    ``what`` names the option in the message, e.g. ``--out``."""
    path = Path(path).expanduser()
    try:
        if path.exists() and not path.is_file():
            kind = _kind(path.stat().st_mode)
            raise DpivonError(f"{what} {path} is {kind}; give a file path, e.g. {path}/out")
        existing = path.parent  # a regular file at path is replaced: its folder is written
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise DpivonError(
                f"{what} {path} is under {existing}, which is a file, not a folder; "
                "give a path in a folder"
            )
        _probe(existing)
    except OSError as err:  # no permission, a read-only or special filesystem, a loop
        raise DpivonError(f"{what} {path} cannot be written: {err.strerror or err}") from None


def check_writable_folder(path: Path, what: str) -> None:
    """A folder can be made (or written in) at ``path``; nothing is created."""
    path = Path(path).expanduser()
    try:
        existing = path
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            where = "is" if existing == path else f"is under {existing}, which is"
            raise DpivonError(f"{what} {path} {where} a file, not a folder; give a folder")
        _probe(existing)
    except OSError as err:
        raise DpivonError(f"{what} {path} cannot be used: {err.strerror or err}") from None


DATA_ENV = "DPIVON_DATA"
DATA_HOW_TO_FIX = (
    f"pass --data-path or set {DATA_ENV} to the tarball, e.g. ../shared/data/cifar10-jpeg.tar.gz"
)


def named_data_path(path: str | Path | None) -> tuple[Path, str] | None:
    """The CIFAR-10 source the user named and what named it: ``path`` ("data path"), else
    ``$DPIVON_DATA``; None where neither names one (`dpivon.data.load_cifar10` looks in its
    cache then). One DpivonError line where it does not exist: here, without numpy or
    torch, so that commands refuse it before they load them."""
    if path is not None:
        named, origin = Path(path).expanduser(), "data path"
    elif os.environ.get(DATA_ENV):
        named, origin = Path(os.environ[DATA_ENV]).expanduser(), DATA_ENV
    else:
        return None
    if not named.exists():
        raise DpivonError(f"{origin} {named} does not exist; {DATA_HOW_TO_FIX}")
    return named, origin


REDACTED = "***"


def redact_uri(uri: str) -> str:
    """The URI with any password replaced by ``***``: what consoles, state files and
    tags may show (``postgresql://user:secret@host/db`` -> ``postgresql://user:***@host/db``)."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}:{REDACTED}@{host}"))
