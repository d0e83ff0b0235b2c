"""What dpivon's entry points (the CLI, a Ray trial) set up before they run: the known,
understood warnings and library chatter off. Library modules never do this at import; a
library call that must quiet a logger does it for its own time (:func:`logger_level`)."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

_KNOWN_WARNINGS = (
    "Secure RNG turned off",  # Opacus's own secure RNG (torchcsprng); ours: privacy.noise
    "Optimal order is the largest alpha",  # RDP: harmless at these budgets
    "Full backward hook is firing",  # torch: inputs need no grad, per-sample grads are exact
)


def quiet_known_output() -> None:
    """Silence what would flood every run's output without telling the user anything."""
    for message in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{message}")
    # progress bars for kilobyte-sized artifact copies only clutter the logs
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # MLflow sets its own loggers' level from this variable when it is first imported (after
    # this call, in the CLI): INFO lines such as "Validating input example against model
    # signature" or "Creating initial MLflow database tables" tell a user nothing to do
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    # dp_accounting warns for every fractional Renyi order whose series does not converge at
    # large sampling rates; it drops those orders, which only loosens the bound
    logging.getLogger("absl").setLevel(logging.ERROR)


@contextmanager
def logger_level(name: str, level: int) -> Iterator[None]:
    """The logger ``name`` at ``level`` inside the block, at its own level after it."""
    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)
