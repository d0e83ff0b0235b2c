"""Connecting a driver (a sweep, a benchmark) to Ray: an existing cluster or a local one."""

from __future__ import annotations

import logging
import os
import socket
import time

import ray
import torch

from dpivon.errors import DpivonError
from dpivon.logs import logger_level
from dpivon.orchestration.run_file import Resources

RAY_CONNECT_TIMEOUT_S = 10.0  # Ray itself retries an unreachable address for minutes
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
NODE_JOIN_WAIT_S = 120.0  # how long a cluster's nodes may take to join before runs start


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
            with logger_level(RAY_AUTH_LOGGER, logging.ERROR):
                ray.init(
                    address=address,
                    include_dashboard=False,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                )
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise DpivonError(f"cannot connect to the Ray cluster at {address}: {err}") from None
    return bool(address) and address != "local"


def _starts_local_ray(address: str | None) -> bool:
    address = address or os.environ.get("RAY_ADDRESS")
    return not address or address == "local"


def _too_big(resources: Resources, what: str, nodes: str) -> DpivonError:
    return DpivonError(
        f"each {what} asks for {resources.cpu:g} CPU and {resources.gpu:g} GPU (the "
        f"resources: key), more than {nodes}; lower resources: or run on a cluster with such "
        "a node"
    )


def check_fits_here(resources: Resources, address: str | None, what: str) -> None:
    """A local Ray is this machine: a ``what`` (trial, run) asking for more than it has is
    refused before Ray starts or a store opens. A cluster's nodes are checked once joined
    (:func:`connect`)."""
    if not _starts_local_ray(address):
        return
    cpus, gpus = len(os.sched_getaffinity(0)), torch.cuda.device_count()
    if resources.cpu > cpus or resources.gpu > gpus:
        raise _too_big(resources, what, f"this machine has ({cpus} CPU, {gpus} GPU)")


def trial_slots(resources: Resources, what: str, wait_s: float = 0.0) -> int:
    """How many ``what``s (trials, runs) the cluster's nodes hold at once (each on one node).

    None fitting anywhere is an error now (Ray would wait forever); nodes that are still
    joining get ``wait_s`` seconds.
    """
    need = {"CPU": resources.cpu, "GPU": resources.gpu}
    deadline = time.monotonic() + wait_s
    while True:
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        slots = sum(
            min(int(node.get(k, 0.0) // v) for k, v in need.items() if v > 0) for node in nodes
        )
        if slots > 0:
            return slots
        if time.monotonic() >= deadline:
            break
        time.sleep(2.0)
    have = "; ".join(f"{n.get('CPU', 0):g} CPU, {n.get('GPU', 0):g} GPU" for n in nodes)
    raise _too_big(resources, what, f"any node of the Ray cluster has (nodes: {have or 'none'})")


def connect(address: str | None, resources: Resources, what: str) -> int:
    """Connect to the Ray cluster (:func:`init_ray`), check that a ``what`` fits on one of
    its nodes, and return how many fit at once."""
    check_fits_here(resources, address, what)
    joined = init_ray(address)
    return trial_slots(resources, what, NODE_JOIN_WAIT_S if joined else 0.0)
