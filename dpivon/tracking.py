"""MLflow tracking: runs, metrics, figures and the posterior model.

Everything goes through one `Tracker` with explicit run ids, so the sweep driver can log
many child runs from one process (SQLite tolerates one writer) and the CLI one run. The
default store is MLflow's own: ``sqlite:///mlflow.db`` in the working directory.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import torch
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types import ParamSchema, ParamSpec, Schema, TensorSpec

from dpivon.config import TrainConfig
from dpivon.errors import DpivonError
from dpivon.evaluation import Posterior, predict_bma, predict_probs
from dpivon.metrics import plot_reliability_diagram
from dpivon.models import build_model
from dpivon.privacy.noise import NOISE_TAG, noise_statement

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_EXPERIMENT = "dpivon"
_MAX_BATCH = 100  # MLflow's limit of params / metrics per log_batch call


def resolve_tracking_uri(uri: str | None) -> str:
    """Explicit URI, else MLFLOW_TRACKING_URI, else a SQLite file in the working directory."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


REDACTED = "***"


def redact_uri(uri: str) -> str:
    """The URI with any password replaced by ``***``: what consoles, state files and
    tags may show (``postgresql://user:secret@host/db`` -> ``postgresql://user:***@host/db``)."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}:{REDACTED}@{host}"))


def check_tracking_server(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with one line, when an HTTP tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
            pass
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise DpivonError(
            f"cannot reach the MLflow tracking server at {redact_uri(uri)} ({reason}); start it "
            "(mlflow server ...) or track to a local store (--tracking-uri sqlite:///mlflow.db)"
        ) from None


def _artifact_location(tracking_uri: str) -> str | None:
    """Artifacts of a SQLite store go beside the database file (MLflow's own default is
    ./mlruns of whatever directory the process runs in); a server decides for itself."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    database = Path(tracking_uri.removeprefix("sqlite:///")).resolve()
    return (database.parent / "mlartifacts").as_uri()


class Tracker:
    """A thin, explicit-run-id layer over MlflowClient."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = DEFAULT_EXPERIMENT):
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        check_tracking_server(self.tracking_uri)
        self.display_uri = redact_uri(self.tracking_uri)
        self.experiment_name = experiment
        try:
            mlflow.set_tracking_uri(self.tracking_uri)
            self.client = MlflowClient(self.tracking_uri)
            existing = self.client.get_experiment_by_name(experiment)
            self.experiment_id = (
                existing.experiment_id
                if existing
                else self.client.create_experiment(
                    experiment, _artifact_location(self.tracking_uri)
                )
            )
        except (MlflowException, ImportError, OSError) as err:  # a store MLflow cannot use
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
            raise DpivonError(
                f"cannot use the tracking URI {self.display_uri}: {first_line[:300]} (use "
                "sqlite:///mlflow.db, a file path, or http(s)://host:port of an MLflow server)"
            ) from None

    def start_run(
        self, run_name: str, *, parent_run_id: str | None = None, tags: Mapping[str, str] = ()
    ) -> str:
        all_tags = dict(tags)
        if parent_run_id is not None:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        return run.info.run_id

    @contextmanager
    def run(
        self,
        run_name: str,
        *,
        parent_run_id: str | None = None,
        tags: Mapping[str, str] = (),
        run_id: str | None = None,
    ) -> Iterator[str]:
        """A run that ends FINISHED, or FAILED (KILLED on Ctrl-C): never left RUNNING.
        With ``run_id``, that existing run (a resumed sweep's parent) runs again."""
        if run_id is None:
            run_id = self.start_run(run_name, parent_run_id=parent_run_id, tags=tags)
        else:
            self.client.update_run(run_id, status="RUNNING")
        try:
            yield run_id
        except KeyboardInterrupt:
            self.end_run(run_id, "KILLED")
            raise
        except BaseException as err:
            if self.reachable():  # a store that is down would stall each write for minutes
                self.set_tags(run_id, {"error": f"{type(err).__name__}: {err}"[:5000]})
                self.end_run(run_id, "FAILED")
            raise
        self.end_run(run_id, "FINISHED")

    def reachable(self) -> bool:
        """False when an HTTP tracking server does not answer its health check."""
        try:
            check_tracking_server(self.tracking_uri)
        except DpivonError:
            return False
        return True

    def end_run(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=status)

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        items = [Param(k, _param_value(v)) for k, v in params.items()]
        for start in range(0, len(items), _MAX_BATCH):
            self.client.log_batch(run_id, params=items[start : start + _MAX_BATCH])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
        now = int(time.time() * 1000)
        items = [
            Metric(k, float(v), now, step)
            for k, v in metrics.items()
            if isinstance(v, int | float) and np.isfinite(v)
        ]
        for start in range(0, len(items), _MAX_BATCH):
            self.client.log_batch(run_id, metrics=items[start : start + _MAX_BATCH])

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_figure(self, run_id: str, figure, artifact_file: str) -> None:
        self.client.log_figure(run_id, figure, artifact_file)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def log_dict(self, run_id: str, data: Mapping, artifact_file: str) -> None:
        self.client.log_dict(run_id, dict(data), artifact_file)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def run_status(self, run_id: str) -> str:
        return self.client.get_run(run_id).info.status


def _param_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list | tuple) else str(value)


PRIVACY_PARAMS = ("noise_multiplier", "sample_rate", "steps", "target_epsilon")


# --- the model ----------------------------------------------------------------------------


def save_checkpoint(
    path: Path, config: TrainConfig, model: torch.nn.Module, posterior: Posterior | None
) -> None:
    """Everything needed to rebuild the predictive: config, mean weights, posterior h."""
    torch.save(
        {
            "config": config.model_dump(mode="json"),
            "model_state": model.state_dict(),
            "posterior": posterior.state_dict() if posterior is not None else None,
        },
        path,
    )


def load_checkpoint(path: str | Path) -> tuple[TrainConfig, torch.nn.Module, Posterior | None]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    config = TrainConfig.model_validate(state["config"])
    model = build_model(config.model.name)
    model.load_state_dict(state["model_state"])
    posterior = Posterior.from_state_dict(state["posterior"]) if state["posterior"] else None
    return config, model, posterior


class PosteriorClassifier(mlflow.pyfunc.PythonModel):
    """MLflow pyfunc: CIFAR-normalised float images (N, 3, 32, 32) -> class probabilities.

    For the IVON family the prediction is BMA over the stored posterior (``bma_samples``
    draws, seeded, overridable with ``params={"bma_samples": n}``); otherwise the point
    prediction.
    """

    def load_context(self, context) -> None:
        self.config, self.model, self.posterior = load_checkpoint(context.artifacts["checkpoint"])
        self.model.eval()

    def predict(self, context, model_input: np.ndarray, params: dict | None = None) -> np.ndarray:
        images = torch.as_tensor(np.asarray(model_input, dtype=np.float32))
        samples = int((params or {}).get("bma_samples", self.config.evaluation.bma_samples))
        if self.posterior is None or samples == 0:
            return predict_probs(self.model, images).numpy()
        generator = torch.Generator().manual_seed(self.config.runtime.seed)
        return predict_bma(self.model, self.posterior, images, samples, generator=generator).numpy()


def _model_signature(config: TrainConfig) -> ModelSignature:
    return ModelSignature(
        inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, 3, 32, 32))]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, 10))]),
        params=ParamSchema([ParamSpec("bma_samples", "long", config.evaluation.bma_samples)]),
    )


def log_model(
    tracker: Tracker,
    run_id: str,
    config: TrainConfig,
    model: torch.nn.Module,
    posterior: Posterior | None,
) -> None:
    """Log the trained model (mean + posterior h) as an MLflow pyfunc model named "model",
    its run tag and metadata saying whether its noise was secure or reproducible."""
    status = tracker.run_status(run_id)
    noise = (
        noise_statement(config.privacy.research_mode)
        if config.is_private
        else "none: a non-private optimizer"
    )
    tracker.set_tags(run_id, {NOISE_TAG: noise})
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint.pt"
        save_checkpoint(checkpoint, config, model, posterior)
        with mlflow.start_run(run_id=run_id):
            mlflow.pyfunc.log_model(
                name="model",
                python_model=str(Path(__file__).with_name("mlflow_model.py")),
                artifacts={"checkpoint": str(checkpoint)},
                signature=_model_signature(config),
                input_example=np.zeros((1, 3, 32, 32), dtype=np.float32),
                pip_requirements=["dpivon", "torch", "mlflow"],
                metadata={NOISE_TAG: noise},
            )
    # Resuming the run above ended it as FINISHED: put back the status it had.
    tracker.client.update_run(run_id, status=status)


def log_training_result(tracker: Tracker, run_id: str, result, *, with_model: bool = True) -> None:
    """Final metrics, privacy facts, the reliability diagram and the model of a TrainResult."""
    summary = result.summary()
    tracker.log_params(run_id, {k: summary[k] for k in PRIVACY_PARAMS})
    # Per-epoch values are already logged; the rest of the summary's numbers are params.
    final = {
        k: v
        for k, v in summary.items()
        if k.startswith("test_") or k in ("wall_time_s", "tuning_epsilon", "epsilon_with_tuning")
    }
    tracker.log_metrics(run_id, final, step=result.config.training.epochs)
    tracker.log_dict(run_id, summary, "summary.json")
    tracker.log_text(run_id, result.config.to_yaml(), "config.yaml")
    if result.test_reliability is not None:
        figure = plot_reliability_diagram(
            result.test_reliability, title=f"{result.config.optimizer.name}: test reliability"
        )
        tracker.log_figure(run_id, figure, "reliability_diagram.png")
    if with_model:
        log_model(tracker, run_id, result.config, result.model, result.posterior)
