"""Reading back the torch files dpivon writes: a `dpivon train --checkpoint`, a benchmark
run's checkpoint, a model file. One reader, safe (``weights_only``: a file cannot run code
when it is loaded) and checked: a truncated, foreign, hand-edited or newer file gets one
line naming the file and what is wrong with it, before any run is opened.

Each file carries its layout's version (``FORMAT_KEY``); the files written before the key
existed have exactly layout 1, so a file without it reads as 1. Each reader names the
layouts it reads (a run checkpoint's changed: `dpivon.runs.checkpoint`).
"""

from __future__ import annotations

import io
import reprlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dpivon.errors import DpivonError, first_line
from dpivon.paths import check_regular_file

FORMAT_KEY = "format"
FORMAT_VERSION = 1


def versioned(payload: Mapping[str, Any], version: int = FORMAT_VERSION) -> dict[str, Any]:
    """``payload`` as a file of layout ``version`` saves it."""
    return {FORMAT_KEY: version, **payload}


Fields = Mapping[str, type | tuple[type, ...]]


def read_saved(
    source: Path | bytes,
    what: str,
    layouts: Mapping[int, Sequence[Fields]],
    where: str | Path | None = None,
) -> dict[str, Any]:
    """The dict a dpivon ``what`` file saved, read from ``source`` (a path, or the bytes of
    the file at ``where``): of one of ``layouts`` (its version -> the field sets a file of it
    may hold, each field of its type), its version under `FORMAT_KEY`; else one DpivonError
    line naming the file."""
    if isinstance(source, Path):
        check_regular_file(source, what)  # a FIFO would block the read forever
        where, data = source, source.read_bytes()
    else:
        data = source
    fix = "delete it or name another file"
    try:
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # torch's errors span many types; its first line says which
        reason = first_line(err, 120)
        raise DpivonError(
            f"{what} {where} is not a file dpivon wrote, or is cut short ({reason}); {fix}"
        ) from None
    if not isinstance(saved, dict):
        raise DpivonError(
            f"{what} {where} holds a {type(saved).__name__}, not a dpivon {what}; {fix}"
        )
    named = saved.get(FORMAT_KEY)
    layout = 1 if named is None else named
    known = type(layout) is int and layout in layouts
    # a dict that names no layout is checked against the newest when layout 1 is not read
    choices = layouts[layout] if known else layouts[max(layouts)] if named is None else None
    if choices is None:
        readable = ", ".join(map(str, sorted(layouts)))
        raise DpivonError(
            f"{what} {where} has layout version {reprlib.repr(layout)}; this dpivon reads "
            f"version {readable}; {fix}"
        )

    def wrong(fields: Fields) -> list[str]:
        return [k for k, kind in fields.items() if k not in saved or not isinstance(saved[k], kind)]

    if all(wrong(fields) for fields in choices):
        lacking = wrong(choices[0])
        raise DpivonError(
            f"{what} {where} lacks {', '.join(repr(k) for k in lacking)} or holds another type "
            f"there, so it is not a dpivon {what}; {fix}"
        )
    return {**saved, FORMAT_KEY: layout}
