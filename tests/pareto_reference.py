"""An O(n^2) Pareto front, independent of dpivon's mask (moocore): the tests' reference."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def brute_force_front(values: np.ndarray, modes: Sequence[str]) -> np.ndarray:
    """O(n^2) reference: i is kept unless some j is >= as good everywhere and > somewhere;
    rows with a NaN are never kept and dominate nothing."""
    signs = [(-1 if m == "max" else 1) for m in modes]
    pts = [[s * x for s, x in zip(signs, row, strict=True)] for row in np.asarray(values).tolist()]
    keep = []
    for i, p in enumerate(pts):
        if any(np.isnan(p)):
            keep.append(False)
            continue
        dominated = False
        for j, q in enumerate(pts):
            if j == i or any(np.isnan(q)):
                continue
            if all(a <= b for a, b in zip(q, p, strict=True)) and any(
                a < b for a, b in zip(q, p, strict=True)
            ):
                dominated = True
                break
        keep.append(not dominated)
    return np.array(keep, dtype=bool)
