"""How a benchmark sits in MLflow: one parent run, one child run per (method, epsilon, seed).

Shared by the driver that writes the runs and the aggregation that reads them back.
"""

from __future__ import annotations

from typing import Any

from dpivon.tracking.layout import RunOutcome

KEY_TAG = "dpivon.benchmark_key"  # "<method>|eps<epsilon>|seed<seed>", see spec.run_key
STATUS_TAG = "dpivon.run_status"  # a RunOutcome: running, completed or failed
CONFIG_HASH_TAG = "dpivon.config_hash"
RELIABILITY_FILE = "reliability.json"  # the test reliability bins of a child run


def is_completed(run: Any) -> bool:
    """A child whose run returned and was fully logged (skipped by --resume)."""
    return run.data.tags.get(STATUS_TAG) == RunOutcome.COMPLETED and run.info.status == "FINISHED"


WEIGHTS_DIR = "weights"  # a completed run's model file (see weights_file), beside the state


def weights_file(key: str) -> str:
    """Where run ``key``'s released weights lie in the benchmark's folder: the model file of
    `dpivon.tracking.model_file.save_model_file` (config, mean, IVON's posterior; no noise
    key, no package copy), small enough to commit with the results."""
    return f"{WEIGHTS_DIR}/{key.replace('|', '_')}.pt"
