"""MLflow tracking: runs, metrics, figures and the posterior model.

Everything goes through one `Tracker` with explicit run ids, so the sweep driver can log
many child runs from one process (SQLite tolerates one writer) and the CLI one run. The
default store is MLflow's own: ``sqlite:///mlflow.db`` in the working directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import torch
from mlflow.entities import LoggedModelStatus, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

from dpivon.config import TrainConfig
from dpivon.data.arrays import CIFAR10_CLASSES, IMAGE_SHAPE
from dpivon.data.images import model_input as model_input_tensor
from dpivon.errors import DpivonError
from dpivon.evaluation import Posterior
from dpivon.models import build_model
from dpivon.plots import plot_reliability_diagram
from dpivon.prediction import predict_with_uncertainty, predictions_frame
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

    def log_changed_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
        """Only the metrics whose latest value on the run differs, or that it lacks: logging
        the same conclusions again (a resumed finished sweep) adds nothing to their history."""
        recorded = self.client.get_run(run_id).data.metrics
        self.log_metrics(run_id, {k: v for k, v in metrics.items() if recorded.get(k) != v}, step)

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

    def has_run(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False
        return True


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


def load_pyfunc(model_uri: str, tracking_uri: str | None = None) -> mlflow.pyfunc.PyFuncModel:
    """A logged model (``runs:/RUN_ID/model``, ``models:/NAME/VERSION``, a path), or one line
    saying why it cannot be loaded."""
    mlflow.set_tracking_uri(resolve_tracking_uri(tracking_uri))
    try:
        return mlflow.pyfunc.load_model(model_uri)
    except (MlflowException, OSError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        raise DpivonError(f"cannot load the model {model_uri}: {first_line[:300]}") from None


class PosteriorClassifier(mlflow.pyfunc.PythonModel):
    """MLflow pyfunc: a batch of images -> one row per image with the class, its
    probability, the predictive entropy, the mutual information across posterior draws
    (IVON family) and every class's probability (:func:`dpivon.prediction.predictions_frame`).

    Images as people have them: uint8 (or any integer) pixels 0-255, or floats in [0, 1],
    (N, 32, 32, 3) or (N, 3, 32, 32); the CIFAR normalisation happens here. Tensors already
    normalised as in training: ``params={"cifar_normalised": True}``. For the IVON family the
    prediction is BMA over ``bma_samples`` posterior draws (``params={"bma_samples": n}``;
    0: at the mean), drawn from a generator seeded by ``seed``, so that one input gives one
    answer wherever it is served; otherwise the point prediction.
    """

    # The model checks its input itself (dpivon.data.images: two dtypes, two layouts), which
    # MLflow's type-hint validation cannot express; without this MLflow warns at every import.
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        self.config, self.model, self.posterior = load_checkpoint(context.artifacts["checkpoint"])
        self.model.eval()

    def predict(self, context, model_input, params: dict | None = None) -> pd.DataFrame:
        params = {**_default_params(self.config), **(params or {})}
        try:
            images = model_input_tensor(
                np.asarray(model_input), cifar_normalised=bool(params["cifar_normalised"])
            )
        except DpivonError as err:  # served: a 400 answer with this one line, not a 500
            raise MlflowException.invalid_parameter_value(str(err)) from None
        generator = torch.Generator().manual_seed(int(params["seed"]))
        predictions = predict_with_uncertainty(
            self.model, self.posterior, images, int(params["bma_samples"]), generator=generator
        )
        return predictions_frame(predictions, CIFAR10_CLASSES)


# The seed of the BMA draws at prediction time: a constant, not the training's seed.
PREDICTION_SEED = 0
# What the logged model imports (dpivon itself travels as code with it), pinned at log time.
MODEL_REQUIREMENTS = (
    "torch", "mlflow", "numpy", "pandas", "pydantic", "pyyaml", "matplotlib", "pillow", "rich",
)  # fmt: skip


def _default_params(config: TrainConfig) -> dict[str, Any]:
    return {
        "bma_samples": config.evaluation.bma_samples,
        "seed": PREDICTION_SEED,
        "cifar_normalised": False,
    }


def pinned_requirements() -> list[str]:
    """``name==version`` of each package the model imports, as installed here, where it
    was trained."""
    return [f"{name}=={metadata.version(name)}" for name in MODEL_REQUIREMENTS]


def _model_signature(config: TrainConfig, posterior: Posterior | None) -> ModelSignature:
    """Outputs and parameters; no input schema: MLflow's tensor schema admits one dtype
    exactly, and the model takes both integer and float images (checked in the model)."""
    columns = [ColSpec("long", "class"), ColSpec("string", "label")]
    columns += [ColSpec("double", name) for name in ("probability", "entropy")]
    if posterior is not None:
        columns.append(ColSpec("double", "mutual_information"))
    columns += [ColSpec("double", f"prob_{name}") for name in CIFAR10_CLASSES]
    defaults = _default_params(config)
    return ModelSignature(
        inputs=None,
        outputs=Schema(columns),
        params=ParamSchema(
            [
                ParamSpec("bma_samples", "long", defaults["bma_samples"]),
                ParamSpec("seed", "long", defaults["seed"]),
                ParamSpec("cifar_normalised", "boolean", defaults["cifar_normalised"]),
            ]
        ),
    )


INPUT_CONTRACT = (
    "a batch of images, (N, 32, 32, 3) or (N, 3, 32, 32): integers are 0-255 pixels, floats "
    "are pixels in [0, 1] (or CIFAR-normalised, with the parameter cifar_normalised=true)"
)


def log_model(
    tracker: Tracker,
    run_id: str,
    config: TrainConfig,
    model: torch.nn.Module,
    posterior: Posterior | None,
) -> None:
    """Log the trained model (mean + posterior h) as an MLflow pyfunc model named "model",
    with the dpivon code it runs and the pinned packages it imports, and its run tag and
    metadata saying whether its noise was secure or reproducible."""
    status = tracker.run_status(run_id)
    noise = (
        noise_statement(config.privacy.research_mode)
        if config.is_private
        else "none: a non-private optimizer"
    )
    tracker.set_tags(run_id, {NOISE_TAG: noise})
    package = Path(__file__).parent
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint.pt"
        save_checkpoint(checkpoint, config, model, posterior)
        code = Path(tmp) / "code" / package.name  # the package without its bytecode caches
        shutil.copytree(package, code, ignore=shutil.ignore_patterns("__pycache__"))
        with mlflow.start_run(run_id=run_id):
            mlflow.pyfunc.log_model(
                name="model",
                python_model=str(package / "mlflow_model.py"),
                artifacts={"checkpoint": str(checkpoint)},
                code_paths=[str(code)],
                signature=_model_signature(config, posterior),
                input_example=(
                    np.zeros((2, *IMAGE_SHAPE), dtype=np.uint8),
                    {"bma_samples": min(config.evaluation.bma_samples, 2)},
                ),
                pip_requirements=pinned_requirements(),
                metadata={"input": INPUT_CONTRACT, NOISE_TAG: noise},
            )
    # Resuming the run above ended it as FINISHED: put back the status it had.
    tracker.client.update_run(run_id, status=status)


def has_logged_model(tracker: Tracker, run_id: str) -> bool:
    """Whether the run has a model logged in full (a resume logs a missing one only)."""
    models = tracker.client.search_logged_models(
        [tracker.experiment_id], filter_string=f"source_run_id = '{run_id}'"
    )
    return any(m.status == LoggedModelStatus.READY for m in models)


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
