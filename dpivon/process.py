"""Process settings that dpivon's entry points apply (`dpivon` commands, Ray trials,
benchmark runs, the benchmark scripts), so that what users run is what the benchmarks time.
Library modules never do this at import."""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters
# "0": leave glibc's defaults (memory given back), for nodes that run many trials at once.
KEEP_FREED_MEMORY_ENV = "DPIVON_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of unmapping or trimming it; False
    where the C library is not glibc.

    By default glibc gives large tensors their own mapping, unmapped when freed, and trims
    the heap top: every training step then page-faults that memory back in and zeroes it
    (measured here: a fifth to a quarter of a tanh-cnn step at batch 256 on a CPU, more for
    the private engines, whose per-example tensors are larger). tcmalloc or jemalloc avoid
    it, as this does. The price: the process keeps its peak memory until it exits, and
    batches of varying size (Poisson sampling) fragment it: a one-thread tanh-cnn DP-SGD
    run at batch 1,024 grew from 3.5 to 5.7 GB resident over 19 steps (3.1 GB peak with
    glibc's defaults, and 1.4x the time), a sweep trial to 11 GB.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def configure_process() -> None:
    """What every entry point sets before it trains: the allocator setting above, unless
    ``DPIVON_KEEP_FREED_MEMORY=0`` (Ray passes the driver's environment to its trials)."""
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1") != "0":
        keep_freed_memory()
