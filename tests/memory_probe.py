"""Every numeric config field, values drawn by Hypothesis, in a process whose memory is
limited (``resource.setrlimit``): each value is refused in one line, or the run it asks for
starts and trains within the limit. Run as a script by `test_memory_bounds.py`:

    python tests/memory_probe.py LIMIT_BYTES EXAMPLES

It limits its own data segment (RLIMIT_DATA: heap and anonymous mappings, where tensors
live) to what it uses after its imports plus LIMIT_BYTES, then prints one line per example
and exits 0, or raises what broke (a MemoryError: a field exhausted the memory)."""

from __future__ import annotations

import math
import resource
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpivon.config import parse_config
from dpivon.errors import DpivonError
from dpivon.optim.registry import OPTIMIZERS
from dpivon.runs import load_data, train

BASE = {
    "dataset": "synthetic", "synthetic_size": 330, "val_size": 30, "model": "small-cnn",
    "epochs": 1, "batch_size": 30, "bma_samples": 2, "val_bma_samples": 1,
}  # fmt: skip
# The fields whose cost is time, not memory: the run is only set up (its first epoch would
# run as long as they ask).
TIME_ONLY = ("epochs", "steps_per_epoch")
EXTREMES = (
    0, 1, -1, 2, 7, 31, 1000, 10**4, 10**6, 10**9, 10**12, 2**31, 2**63 - 1, 2**64,
    0.0, 0.5, 1.5, 1e-300, 1e-6, 1e6, 1e12, 1e300, math.inf, -math.inf, math.nan,
)  # fmt: skip
VALUES = st.one_of(
    st.sampled_from(EXTREMES),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
)


def numeric_fields() -> dict[str, list[str]]:
    """Per optimizer, every flat config key that holds a number (or None: an unset one)."""
    fields = {}
    for name in sorted(OPTIMIZERS):
        flat = parse_config({**BASE, "optimizer": name}).flat()
        fields[name] = sorted(
            key
            for key, value in flat.items()
            if key not in ("data_path", "tuning")  # a path; computed, refused when set
            and (value is None or type(value) in (int, float))
        )
    return fields


def data_in_use() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def main() -> None:
    limit, examples = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    fields = numeric_fields()
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (data_in_use() + limit, hard))

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(data=st.data())
    def probe(data: st.DataObject) -> None:
        optimizer = data.draw(st.sampled_from(sorted(fields)), label="optimizer")
        field = data.draw(st.sampled_from(fields[optimizer]), label="field")
        value = data.draw(VALUES, label="value")
        try:
            config = parse_config({**BASE, "optimizer": optimizer, field: value})
            splits = load_data(config)
            if field in TIME_ONLY:
                print(f"{optimizer} {field}={value!r}: accepted (time only, not run)")
                return
            train(config.replace(epochs=1), data=splits)
        except DpivonError as err:
            message = str(err)
            assert message.strip() and "\n" not in message.strip(), message
            print(f"{optimizer} {field}={value!r}: refused: {message[:120]}")
            return
        print(f"{optimizer} {field}={value!r}: trained within the limit")

    probe()


if __name__ == "__main__":
    main()
