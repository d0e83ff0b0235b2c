"""What this process may still allocate: the machine's available memory, within the limits
set on the process (``resource.setrlimit``: RLIMIT_AS, RLIMIT_DATA) and its container
(cgroup v2 ``memory.max``). A size a config asks for is checked against it before the
allocation, so that a value that fits the config's static bound but not this machine is one
line instead of the kernel's OOM killer."""

from __future__ import annotations

import resource
from pathlib import Path

from dpivon.constraints import size_text
from dpivon.errors import DpivonError

_MEMINFO = Path("/proc/meminfo")
_STATUS = Path("/proc/self/status")
_CGROUP = Path("/sys/fs/cgroup")


def _kib_field(path: Path, name: str) -> int | None:
    """``name:   123 kB`` of a /proc file, in bytes (None where the file or field is not)."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(f"{name}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        used = int((_CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else int(limit) - used


def _rlimit_room(limit: int, used_field: str) -> int | None:
    soft, _ = resource.getrlimit(limit)
    used = _kib_field(_STATUS, used_field)
    return None if soft == resource.RLIM_INFINITY or used is None else soft - used


def available_memory() -> int:
    """Bytes this process can allocate now: the least of what the machine has available
    and what its limits leave (each where it can be read; a machine that shows none is
    not limited here)."""
    rooms = [
        _kib_field(_MEMINFO, "MemAvailable"),
        _rlimit_room(resource.RLIMIT_AS, "VmSize"),
        _rlimit_room(resource.RLIMIT_DATA, "VmData"),
        _cgroup_room(),
    ]
    known = [room for room in rooms if room is not None]
    return max(0, min(known)) if known else 2**63 - 1


def check_memory(what: str, need: int) -> None:
    """One line, before allocating, when ``what`` would need more than `available_memory`."""
    room = available_memory()
    if need > room:
        raise DpivonError(
            f"{what} would need {size_text(need)} in memory; this process can allocate "
            f"{size_text(room)} now (the machine's available memory within its limits)"
        )
