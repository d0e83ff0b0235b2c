"""How busy one sweep keeps a cluster, and what its single MLflow writer (the driver) costs.

A real ``dpivon sweep`` (run_sweep: every group's own Optuna study and ASHA, all groups in
one Tune experiment, MLflow child runs written by the driver) of the eps-grid study's
shape (pipelines/cifar10-eps-grid.yaml: 4 epsilons x 3 optimizers) with tiny trials
(synthetic data, small-cnn, the quickstart spaces), on a simulated cluster: Ray started
with logical resources (``--cpus``, ``--gpus``) on this machine. GPU trials run on the CPU,
so trial durations stretch with this machine's cores; the figures are about scheduling and
the driver, not training speed.

Printed, once trials have started (first trial start to last trial end, from the MLflow
child runs' start times and their last epoch's metrics, which the driver stamps as Tune
starts a trial and as it reports):

- occupancy: busy resource-seconds (each trial's duration x its CPU / GPU request) over
  the cluster's available resource-seconds, and the same over the trial slots the
  pipeline allows (concurrency, or what fits);
- the most groups with trials in flight at once;
- driver overhead per trial: the driver process's CPU time in that span over the trials,
  and its MLflow write time (every MlflowClient write is counted and timed in-process);
- MLflow writes per second, per trial-epoch, and where the single writer would saturate
  (busy writing all the time): at its measured latency, the trial-epochs per second it
  can record, and the trials in flight that takes at ``--epoch-seconds`` per epoch.

    python benchmarks/occupancy.py            # reduced: 24 trials of 2 epochs, 4 slots
    python benchmarks/occupancy.py --trials 32 --trial-count poisson --epochs 30 \
        --cpus 32 --gpus 4 --trial-cpu 4 --concurrency 8      # the study's scale and shape
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import yaml
from mlflow.tracking import MlflowClient

from dpivon.search.pipeline import load_pipeline
from dpivon.search.results import GROUP_TAG
from dpivon.search.sweep import SweepState, run_sweep
from dpivon.tracking.client import Tracker

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "pipelines" / "cifar10-eps-grid.yaml"
SPACES = REPO / "search_spaces" / "quickstart"
WRITES = ("create_run", "log_batch", "set_terminated", "update_run")


class WriteLog:
    """Every MLflow write of this process (the driver, the sweep's only writer): when it
    started and how long it took."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []

    def install(self) -> None:
        for name in WRITES:
            setattr(MlflowClient, name, self._timed(getattr(MlflowClient, name)))

    def _timed(self, method: Callable) -> Callable:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.time()
            try:
                return method(*args, **kwargs)
            finally:
                self.calls.append((started, time.time() - started))

        return timed

    def within(self, start: float, end: float) -> np.ndarray:
        """Latencies (s) of the writes that started in [start, end]."""
        return np.array([d for t, d in self.calls if start <= t <= end])


class CpuClock:
    """The driver's CPU time (all its threads), sampled twice a second."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), time.process_time()))
            self._stop.wait(0.5)

    def __enter__(self) -> CpuClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> float:
        wall, cpu = np.array(self.samples).T
        return float(np.interp(end, wall, cpu) - np.interp(start, wall, cpu))


def write_pipeline(args: argparse.Namespace, folder: Path) -> Path:
    """The eps-grid study, with tiny trials and this run's scale."""
    study = yaml.safe_load(STUDY.read_text())
    study.update(
        name="occupancy",
        data={"dataset": "synthetic", "synthetic_size": 600},
        model="small-cnn",
        epochs=args.epochs,
        trials=args.trials,
        trial_count=args.trial_count,
        concurrency=args.concurrency,
        resources={"cpu": args.trial_cpu, "gpu": args.trial_gpu},
        scheduler={"type": "asha", "grace_period": max(1, args.epochs // 6), "reduction_factor": 2},
        optimizers=[
            {"name": e["name"], "space": str(SPACES / Path(e["space"]).name)}
            for e in study["optimizers"]
        ],
        tracking_uri=f"sqlite:///{folder}/mlflow.db",
        storage_path=str(folder / "runs"),
        train={"bma_samples": 2},
    )
    path = folder / "occupancy.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=2, help="per group (the mean if drawn)")
    parser.add_argument("--trial-count", default="fixed", help="fixed | poisson | geometric")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--cpus", type=float, default=4, help="logical CPUs of the cluster")
    parser.add_argument("--gpus", type=float, default=2, help="logical GPUs of the cluster")
    parser.add_argument("--trial-cpu", type=float, default=1)
    parser.add_argument("--trial-gpu", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=0, help="0: what the cluster fits")
    parser.add_argument(
        "--epoch-seconds",
        type=float,
        default=60.0,
        help="a real trial epoch, for the saturation estimate",
    )
    args = parser.parse_args()
    args.concurrency = args.concurrency or None

    writes = WriteLog()
    writes.install()
    with tempfile.TemporaryDirectory(prefix="dpivon-occupancy-") as tmp:
        pipeline = load_pipeline(write_pipeline(args, Path(tmp)))
        ray.init(
            num_cpus=args.cpus, num_gpus=args.gpus, include_dashboard=False, log_to_driver=False
        )
        started = time.time()
        with CpuClock() as cpu_clock:
            run_sweep(pipeline)
        ended = time.time()
        tracker = Tracker(pipeline.tracking_uri, pipeline.experiment)
        runs = tracker.child_runs(SweepState.load(pipeline.storage).parent_run_id)
        ray.shutdown()

    # A run ends at its last epoch's metrics: logging a front member's model at the end of
    # the sweep moves its MLflow end_time to then.
    histories = [tracker.metric_history(r.info.run_id, "val_accuracy") for r in runs]
    spans = (
        np.array(
            [
                (r.info.start_time, max((m.timestamp for m in h), default=r.info.end_time))
                for r, h in zip(runs, histories, strict=True)
            ]
        )
        / 1000.0
    )
    first, last = spans[:, 0].min(), spans[:, 1].max()
    window = last - first
    busy = float((spans[:, 1] - spans[:, 0]).sum())
    slots = min(
        args.cpus // args.trial_cpu,
        args.gpus // args.trial_gpu if args.trial_gpu else np.inf,
        args.concurrency or np.inf,
    )
    groups = [r.data.tags[GROUP_TAG] for r in runs]
    in_flight = max(
        len({g for g, (s, e) in zip(groups, spans, strict=True) if s <= t < e}) for t in spans[:, 0]
    )
    epochs = sum(len(h) for h in histories)
    latency = writes.within(first, last)
    capacity = 1.0 / latency.mean()  # writes per second when the writer never rests
    per_epoch = len(latency) / epochs
    driver_cpu = cpu_clock.between(first, last)

    print(
        f"sweep: {len(set(groups))} groups, {len(runs)} trials, {epochs} trial-epochs; "
        f"cluster {args.cpus:g} CPU / {args.gpus:g} GPU (logical), each trial "
        f"{args.trial_cpu:g} CPU / {args.trial_gpu:g} GPU, {slots:g} slots"
    )
    print(
        f"wall: {ended - started:.0f} s in all; setup {first - started:.0f} s, trials "
        f"{window:.0f} s, report {ended - last:.0f} s"
    )
    print(
        f"occupancy once started: CPU {busy * args.trial_cpu / (args.cpus * window):.1%}, "
        f"GPU {busy * args.trial_gpu / (args.gpus * window):.1%}, slots "
        f"{busy / (slots * window):.1%}; mean trial {busy / len(runs):.1f} s"
    )
    print(f"groups in flight at once: up to {in_flight} of {len(set(groups))}")
    print(
        f"driver per trial: {driver_cpu / len(runs):.2f} CPU-s "
        f"({driver_cpu / window:.0%} of one core over the trials); its MLflow writes "
        f"take {latency.sum() / len(runs):.3f} s of wall time per trial"
    )
    print(
        f"MLflow: {len(latency) / window:.1f} writes/s ({per_epoch:.1f} per trial-epoch), "
        f"mean latency {latency.mean() * 1000:.1f} ms, p95 "
        f"{np.percentile(latency, 95) * 1000:.1f} ms; the writer is busy "
        f"{latency.sum() / window:.1%} of the time"
    )
    print(
        f"single writer saturates at ~{capacity:.0f} writes/s = "
        f"{capacity / per_epoch:.0f} trial-epochs/s: at {args.epoch_seconds:g} s per epoch, "
        f"~{capacity / per_epoch * args.epoch_seconds:.0f} trials in flight"
    )


if __name__ == "__main__":
    main()
