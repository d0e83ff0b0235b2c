"""Optimizers: IVON, DP-IVON-Gradsq and its ablations, DP-AdamBC (`ivon`, `adambc`), and the
registry of every optimizer a config can name (`registry`, importable without torch).

The public classes are importable from here (``from dpivon.optim import IVON, DPIVON``);
they load on first use, so importing the registry alone never imports torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpivon.optim.adambc import DPAdamBC
    from dpivon.optim.dp_ivon import DPIVON
    from dpivon.optim.ivon import IVON

__all__ = ["DPIVON", "IVON", "DPAdamBC"]

_HOMES = {
    "IVON": "dpivon.optim.ivon",
    "DPIVON": "dpivon.optim.dp_ivon",
    "DPAdamBC": "dpivon.optim.adambc",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'dpivon.optim' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
