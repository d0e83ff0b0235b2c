"""How a driver (a sweep, a benchmark) is stopped: SIGINT (Ctrl-C) and SIGTERM alike raise
`Interrupted`, a KeyboardInterrupt, so that the driver's own clean-up runs (runs in flight
end KILLED and keep their checkpoints) and the process exits with the shell's code."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the driver; ``--resume`` continues what it was running."""

    def __init__(self, signal_number: int):
        super().__init__(f"interrupted by {signal.Signals(signal_number).name}")
        self.signal_number = signal_number

    @property
    def exit_code(self) -> int:
        return 128 + self.signal_number  # the shell's convention: 130 SIGINT, 143 SIGTERM


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """While active, SIGINT and SIGTERM raise `Interrupted` in the main thread (handlers
    can only be set there; elsewhere the defaults stay)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def interrupt(number: int, frame) -> None:
        received.append(number)
        raise Interrupted(number)

    previous = {number: signal.signal(number, interrupt) for number in STOP_SIGNALS}
    try:
        yield
    except KeyboardInterrupt as err:
        if received and not isinstance(err, Interrupted):  # re-raised as a plain one (Ray)
            raise Interrupted(received[0]) from None
        raise
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
