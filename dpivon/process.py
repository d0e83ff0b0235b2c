"""Process settings that dpivon's entry points apply (`dpivon` commands, Ray trials,
benchmark runs, the benchmark scripts), so that what users run is what the benchmarks time.
Library modules never do this at import."""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of unmapping or trimming it; False
    where the C library is not glibc.

    By default glibc gives large tensors their own mapping, unmapped when freed, and trims
    the heap top: every training step then page-faults that memory back in and zeroes it
    (measured here: a fifth to a quarter of a tanh-cnn step at batch 256 on a CPU, more for
    the private engines, whose per-example tensors are larger). tcmalloc or jemalloc avoid
    it, as this does. The price: the process keeps its peak memory until it exits.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def configure_process() -> None:
    """What every entry point sets before it trains: the allocator setting above."""
    keep_freed_memory()
