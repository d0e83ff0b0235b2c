"""Where a run's time goes (`dpivon train --profile`): named phases, timed as they run."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

# Loading the data and drawing and moving batches, building model, optimizer and privacy
# plan, optimizer steps, the per-epoch validation, the curvature diagnostics, building
# resumable checkpoints, the rest of the epoch callbacks (MLflow writes in the CLI, with the
# final ones; saving and reporting checkpoints to Ray in trials) and the final test.
PHASES = (
    "data", "setup", "train", "validation", "diagnostics", "checkpoint", "logging", "test",
)  # fmt: skip


class PhaseTimes:
    """Seconds spent in each of `PHASES`; on CUDA a phase ends when the device is done."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.device: torch.device | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] += time.perf_counter() - start


def timed_batches(
    loader: Iterable, device: torch.device, phases: PhaseTimes
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches on ``device``; drawing and moving them counts as "data"."""
    batches = iter(loader)
    while True:
        with phases.phase("data"):
            batch = next(batches, None)
            if batch is not None:
                x, y = (t.to(device) for t in batch)
        if batch is None:
            return
        yield x, y
