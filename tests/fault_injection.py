"""A test-only fault: a run raises after a chosen epoch, which the failure-recording and
retry tests need. Production code has no such hook; tests install it.

- In-process: pass ``fail_after(epoch)`` as ``train``'s ``on_epoch_end``.
- In Ray trial workers: start Ray with ``runtime_env=trial_faults_runtime_env(path)``; then,
  inside ``with injected_faults(path, {"dp-sgd": 1}):``, every dp-sgd trial raises after
  its epoch 1. Only the attempt that trains that epoch fails: a retry resumed from the
  epoch's checkpoint goes on, like after a transient crash. With ``{"dp-sgd": KILLED}``
  the worker process of every dp-sgd trial dies while its actor is created, before the
  trial starts (as when the kernel kills it for memory): Tune reports an error for a
  trial that never started. ``{NOISE_KEY: key.hex()}`` makes the OS entropy source of every
  trial return that key, and each resumed attempt appends the names in its resume state's
  randomness state to the file ``{RESUMED_STATES: path}``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

FAULTS_FILE_ENV = "DPIVON_TEST_FAULTS_FILE"
KILLED = "killed before start"
NOISE_KEY = "noise key"
RESUMED_STATES = "resumed states"


class InjectedFailure(RuntimeError):
    """Raised on purpose to exercise failure handling."""


def fail_after(epoch: int, then: Callable | None = None) -> Callable:
    """An ``on_epoch_end`` callback that raises after ``epoch`` (after ``then`` ran)."""

    def on_epoch_end(report) -> None:
        if then is not None:
            then(report)
        if report.epoch == epoch:
            raise InjectedFailure(f"failure injected after epoch {epoch}")

    return on_epoch_end


def install() -> None:
    """Ray's ``worker_process_setup_hook``: wrap the trials' training so that it reads the
    faults file at every trial start (a file, so a test can change the faults while the
    workers live)."""
    from ray.tune.trainable.function_trainable import FunctionTrainable

    from dpivon.privacy import noise
    from dpivon.search import trial
    from dpivon.search.groups import GROUP_KEY

    real_train, real_setup, real_key = trial.train, FunctionTrainable.setup, noise.os_key
    faults_file = Path(os.environ[FAULTS_FILE_ENV])

    def faults() -> dict:
        return json.loads(faults_file.read_text()) if faults_file.exists() else {}

    def os_key() -> bytes:
        key = faults().get(NOISE_KEY)
        return real_key() if key is None else bytes.fromhex(key)

    def train(config, *, on_epoch_end=None, resume_state=None, **kwargs):
        epoch = faults().get(config.optimizer.name)
        if isinstance(epoch, int):
            on_epoch_end = fail_after(epoch, on_epoch_end)
        record = faults().get(RESUMED_STATES)
        if record is not None and resume_state is not None:
            with open(record, "a") as file:
                print(json.dumps(sorted(resume_state["rng"]["randomness"])), file=file)
        return real_train(config, on_epoch_end=on_epoch_end, resume_state=resume_state, **kwargs)

    def setup(self, config, *args, **kwargs):  # in the trial actor's creation
        killed = [name for name, fault in faults().items() if fault == KILLED]
        if any(str(config.get(GROUP_KEY, "")).endswith(f"-{name}") for name in killed):
            os._exit(1)  # no exception, no clean-up: the process is gone
        return real_setup(self, config, *args, **kwargs)

    trial.train = train
    FunctionTrainable.setup = setup
    noise.os_key = os_key


def trial_faults_runtime_env(faults_file: Path) -> dict:
    """The ``runtime_env`` for ``ray.init`` that installs the hook in every worker."""
    tests = str(Path(__file__).parent)
    return {
        "env_vars": {
            FAULTS_FILE_ENV: str(faults_file),
            "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])),
        },
        "worker_process_setup_hook": "fault_injection.install",
    }


@contextmanager
def injected_faults(faults_file: Path, faults: dict[str, int | str]) -> Iterator[None]:
    """Within the block, trials of each named optimizer fail after the given epoch, or
    are killed before they start (:data:`KILLED`)."""
    faults_file.write_text(json.dumps(faults))
    try:
        yield
    finally:
        faults_file.unlink(missing_ok=True)


# Installed as sitecustomize.py: Python imports it at the start of every process whose path
# holds it, the driver's and the Ray workers' it starts (they inherit PYTHONPATH), so a
# driver run as a command draws its trials' noise keys from it too.
_KNOWN_KEY_SITE = """
import importlib.abc, importlib.util, os, sys

KEY = bytes.fromhex({key!r})
DRAWN = {drawn!r}


def os_key():
    with open(DRAWN, "a") as file:
        print(os.getpid(), file=file)
    return KEY


class PatchNoiseKeys(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "dpivon.privacy.noise":
            return None
        sys.meta_path.remove(self)  # the module once, as found without this finder
        spec = importlib.util.find_spec(name)
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            module.os_key = os_key

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, PatchNoiseKeys())
"""


def known_key_environment(folder: Path, key: bytes) -> dict[str, str]:
    """The environment of a dpivon command whose noise keys, in it and in every Ray worker
    it starts, are ``key`` instead of the OS's entropy (each key drawn appends the drawing
    process's id to ``folder / "keys-drawn"``)."""
    folder.mkdir(parents=True, exist_ok=True)
    site = _KNOWN_KEY_SITE.format(key=key.hex(), drawn=str(folder / "keys-drawn"))
    (folder / "sitecustomize.py").write_text(site)
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}
