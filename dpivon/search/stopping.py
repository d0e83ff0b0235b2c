"""Stopping a sweep cleanly: while a sweep runs, SIGINT and SIGTERM ask Tune for its graceful
stop once the trials' reported checkpoints are registered, so ``--resume`` restarts every
trial in flight from its last checkpoint; a second signal stops at once."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from ray import tune
from rich.console import Console

from dpivon.orchestration.interrupts import STOP_SIGNALS, Interrupted
from dpivon.process import environment_variable

SAVE_WAIT_S = 30.0  # how long a stop waits for the trials' reported checkpoints to register
_TUNE_SIGINT_ENV = "TUNE_DISABLE_SIGINT_HANDLER"
console = Console(stderr=True)


class SweepInterrupted(Interrupted):
    """SIGINT or SIGTERM stopped the sweep: its trials keep their checkpoints, its parent
    run is KILLED, ``--resume`` finishes it. A KeyboardInterrupt, so runs end KILLED."""


class StopOnSignals:
    """While active, SIGINT and SIGTERM stop the sweep cleanly.

    Inside ``Tuner.fit`` the first signal asks for Tune's own graceful stop (its SIGUSR1
    handler): Tune saves the experiment with the trials in flight, so a resume restarts
    them from their last checkpoints. Tune registers a reported checkpoint one step after
    the report, so the stop waits for those (:class:`StopWhenSaved`, at most
    ``SAVE_WAIT_S``). Anywhere else, or at a second signal, the signal raises
    :class:`SweepInterrupted` at once.
    """

    active: StopOnSignals | None = None  # the one of this process, for StopWhenSaved

    def __enter__(self) -> StopOnSignals:
        self.received: int | None = None
        self._tuning = self._stopping = False
        self._deadline = 0.0
        # Handlers can only be set from the main thread; elsewhere the defaults stay.
        self._active = threading.current_thread() is threading.main_thread()
        if self._active:
            self._usr1 = signal.getsignal(signal.SIGUSR1)
            self._previous = {
                number: signal.signal(number, self._handle) for number in STOP_SIGNALS
            }
            # Tune would take SIGINT over during fit and swallow it; this handler decides.
            self._environment = ExitStack()
            self._environment.enter_context(environment_variable(_TUNE_SIGINT_ENV, "1"))
            StopOnSignals.active = self
        return self

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        StopOnSignals.active = None
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        signal.signal(signal.SIGUSR1, self._usr1)
        self._environment.close()

    @contextmanager
    def tuning(self) -> Iterator[None]:
        self._tuning = True
        try:
            yield
        finally:
            self._tuning = False

    def _handle(self, number: int, frame) -> None:
        if self.received is None and self._tuning:
            self.received, self._deadline = number, time.monotonic() + SAVE_WAIT_S
            console.print(
                f"{signal.Signals(number).name}: stopping the sweep; the trials "
                "keep their checkpoints (again to stop at once)"
            )
            return
        raise SweepInterrupted(self.received or number)

    def stop_tune_once_saved(self, trials: list) -> None:
        """Between two steps of Tune's loop: after a signal, and once no trial's checkpoint
        is being registered, trigger Tune's graceful stop."""
        tune_stop = signal.getsignal(signal.SIGUSR1)  # installed when Tune's loop starts
        if self.received is None or self._stopping or tune_stop is self._usr1:
            return
        if any(t.is_saving for t in trials) and time.monotonic() < self._deadline:
            return
        self._stopping = True
        tune_stop(self.received, None)


class StopWhenSaved(tune.Callback):
    """Lets the driver's signal handling stop Tune between steps (see StopOnSignals)."""

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        if StopOnSignals.active is not None:
            StopOnSignals.active.stop_tune_once_saved(trials)
