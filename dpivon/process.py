"""Process settings that dpivon's entry points apply (`dpivon` commands, Ray trials,
benchmark runs, the benchmark scripts), so that what users run is what the benchmarks time.
Library modules never do this at import.

The allocator, ``DPIVON_ALLOCATOR``:

- ``jemalloc`` (the default): the `dpivon` command restarts itself once with the jemalloc
  that Ray's wheel ships preloaded, told never to give freed memory back
  (`JEMALLOC_CONF`); Ray's local workers inherit it. Without it glibc gives each large
  tensor its own mapping, unmapped when freed, and every training step page-faults that
  memory back in and zeroes it. Measured on a 2-core CPU (tanh-cnn DP-SGD, batch 1,024, 20
  steps, two threads): 33 s and 3.9 GB resident, against 38 s and 6.2 GB with
  ``keep-freed`` and 87 s and 3.6 GB with ``glibc``.
- ``keep-freed``: glibc told to keep freed memory (`keep_freed_memory`); the setting of a
  process that was not started with jemalloc (a library caller, a remote Ray worker).
  Poisson batches of varying size fragment what it keeps: a full-data trial grew to 11-15 GB.
- ``glibc``: glibc's defaults, memory given back at once.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dpivon.errors import DpivonError
from dpivon.logs import quiet_known_output

ALLOCATOR_ENV = "DPIVON_ALLOCATOR"
ALLOCATORS = ("jemalloc", "keep-freed", "glibc")
# jemalloc's purging off: freed pages stay mapped for the next step, as with keep-freed
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
_RESTARTED_ENV = "DPIVON_ALLOCATOR_RESTARTED"  # set for the restart: it happens once
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters


def allocator() -> str:
    """The allocator ``DPIVON_ALLOCATOR`` asks for (default jemalloc)."""
    choice = os.environ.get(ALLOCATOR_ENV, "jemalloc")
    if choice not in ALLOCATORS:
        raise DpivonError(f"{ALLOCATOR_ENV} must be one of {', '.join(ALLOCATORS)}, got {choice!r}")
    return choice


def jemalloc_library() -> Path | None:
    """The jemalloc that Ray's wheel ships (Ray is a dependency), where it ships one."""
    spec = importlib.util.find_spec("ray")  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    library = Path(spec.submodule_search_locations[0]) / "core" / "libjemalloc.so"
    return library if library.is_file() else None


def jemalloc_loaded() -> bool:
    """Whether this process runs on jemalloc (Linux; False where it cannot tell)."""
    try:
        return "libjemalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def preload_jemalloc() -> None:
    """Restart this process (same arguments, same PID) with jemalloc preloaded when it is
    the allocator asked for, available and not loaded yet; call it before any work."""
    if allocator() != "jemalloc" or os.environ.get(_RESTARTED_ENV) or jemalloc_loaded():
        return
    library = jemalloc_library()
    if library is None:
        return
    env = dict(os.environ, **{_RESTARTED_ENV: "1"})
    env["LD_PRELOAD"] = " ".join(filter(None, (str(library), env.get("LD_PRELOAD"))))
    env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of unmapping or trimming it; False
    where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def configure_process() -> None:
    """What every entry point sets before it trains: nothing more on jemalloc (preloaded by
    the `dpivon` command, inherited by local Ray workers); glibc keeping freed memory where
    jemalloc was asked for but is not loaded, or ``keep-freed`` was asked for."""
    choice = allocator()
    if choice == "keep-freed" or (choice == "jemalloc" and not jemalloc_loaded()):
        keep_freed_memory()


@contextmanager
def environment_variable(name: str, value: str) -> Iterator[None]:
    """``name`` set to ``value`` in this process's environment inside the block, and as it
    was (set or not) after it: what a library call needs there stays its own."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def enter_ray_worker(threads: int) -> None:
    """What a trial or benchmark run sets where it starts, a Ray worker being an entry point
    of its own: the known output quiet, the allocator, and its CPU share as torch's thread
    count (``threads``). Called by the Ray-side wrappers only, never by the training code
    itself, so that a caller in its own process keeps its own settings."""
    import torch  # here: the CLI imports this module before its jemalloc restart

    quiet_known_output()
    configure_process()
    torch.set_num_threads(max(1, threads))
