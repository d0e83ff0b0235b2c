"""Connecting a driver (a sweep, a benchmark) to Ray: an existing cluster or a local one."""

from __future__ import annotations

import logging
import os
import socket

import optuna
import ray

from dpivon.errors import DpivonError

RAY_CONNECT_TIMEOUT_S = 10.0  # Ray itself retries an unreachable address for minutes
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def _check_reachable(address: str) -> None:
    """Nothing answering at a host:port address is one line within seconds, not minutes of
    Ray's own retries. ``auto`` and ``local`` are Ray's to resolve."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if address in ("auto", "local") or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), RAY_CONNECT_TIMEOUT_S):
            pass
    except OSError as err:
        raise DpivonError(
            f"cannot reach the Ray cluster at {address} within {RAY_CONNECT_TIMEOUT_S:g} s "
            f"({err or type(err).__name__}); check --address / RAY_ADDRESS, or omit both for "
            "a local Ray"
        ) from None


def init_ray(address: str | None) -> bool:
    """Connect to the cluster at ``address`` (else $RAY_ADDRESS, else start a local Ray);
    True when this joined an existing cluster, whose nodes may still be joining."""
    # Trial failures are reported by SweepProgress in one line and recorded in MLflow;
    # Tune's own tracebacks and state messages would bury them.
    logging.getLogger("ray.tune").setLevel(logging.CRITICAL)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0: no Tune tables at all
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")  # resumable within a second
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        _check_reachable(address)
    try:
        if address and address != "local":
            ray.init(address=address, log_to_driver=False)
        else:
            # Ray starts its local cluster with token authentication (its default, kept) and
            # warns about that default at every start: nothing there for the user to do.
            # (RAY_AUTH_MODE=token set here instead would come after Ray read its config.)
            # "local" starts a cluster of this process's own even beside a `ray start` one.
            logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise DpivonError(f"cannot connect to the Ray cluster at {address}: {err}") from None
    return bool(address) and address != "local"
