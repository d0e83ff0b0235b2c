"""The served model: an MLflow pyfunc that takes raw images and answers with the class,
its probability and the uncertainty of the posterior predictive (IVON family), logged with
the dpivon code it runs (``dpivon/mlflow_model.py`` is its entry point)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import torch
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

from dpivon.config import TrainConfig
from dpivon.data.arrays import CIFAR10_CLASSES, IMAGE_SHAPE
from dpivon.data.images import model_input as model_input_tensor
from dpivon.errors import DpivonError, first_line
from dpivon.evaluation import Posterior
from dpivon.evaluation.prediction import predict_with_uncertainty, predictions_frame
from dpivon.orchestration.interrupts import Interrupted, signals_interrupt
from dpivon.privacy.noise import noise_tags
from dpivon.tracking.client import Tracker, fluent_tracking_uri
from dpivon.tracking.model_file import load_model_file, save_model_file
from dpivon.tracking.model_trust import (
    BYTECODE,
    CODE_FOLDER,
    ENTRY_POINT,
    PACKAGE,
    verified_model_folder,
)


class PosteriorClassifier(mlflow.pyfunc.PythonModel):
    """MLflow pyfunc: a batch of images -> one row per image with the class, its
    probability, the predictive entropy, the mutual information across posterior draws
    (IVON family) and every class's probability
    (:func:`dpivon.evaluation.prediction.predictions_frame`).

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
        self.config, self.model, self.posterior = load_model_file(context.artifacts["checkpoint"])
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
    noise = noise_tags(config.privacy.research_mode, config.is_private)
    tracker.set_tags(run_id, noise)  # set when the run opened; a run of an older store lacks it
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint.pt"
        save_model_file(checkpoint, config, model, posterior)
        code = Path(tmp) / CODE_FOLDER / PACKAGE.name  # the package without its bytecode caches
        shutil.copytree(PACKAGE, code, ignore=shutil.ignore_patterns(BYTECODE))
        with fluent_tracking_uri(tracker.tracking_uri), mlflow.start_run(run_id=run_id):
            mlflow.pyfunc.log_model(
                name="model",
                python_model=str(ENTRY_POINT),
                artifacts={"checkpoint": str(checkpoint)},
                code_paths=[str(code)],
                signature=_model_signature(config, posterior),
                input_example=(
                    np.zeros((2, *IMAGE_SHAPE), dtype=np.uint8),
                    {"bma_samples": min(config.evaluation.bma_samples, 2)},
                ),
                pip_requirements=pinned_requirements(),
                metadata={"input": INPUT_CONTRACT, **noise},
            )
    # Resuming the run above ended it as FINISHED: put back the status it had.
    tracker.set_run_status(run_id, status)


def load_pyfunc(
    model_uri: str, tracking_uri: str | None = None, trust_code: bool = False
) -> mlflow.pyfunc.PyFuncModel:
    """A logged model (``runs:/RUN_ID/model``, ``models:/NAME/VERSION``, a path) whose code
    is the installed dpivon's (`dpivon.tracking.model_trust`; any code with ``trust_code``),
    or one line saying why it cannot be loaded."""
    with verified_model_folder(model_uri, tracking_uri, trust_code) as folder:
        try:
            return mlflow.pyfunc.load_model(str(folder))
        except (MlflowException, OSError) as err:
            raise DpivonError(f"cannot load the model {model_uri}: {first_line(err)}") from None


def serve_model(
    model_uri: str,
    host: str,
    port: int,
    tracking_uri: str | None = None,
    trust_code: bool = False,
) -> int:
    """Serve a logged model over REST (``mlflow models serve`` in this environment) once its
    code is checked as :func:`load_pyfunc` checks it, until SIGINT or SIGTERM stops it; the
    server's exit code (128 + the signal's number when stopped)."""
    with verified_model_folder(model_uri, tracking_uri, trust_code) as folder:
        command = [
            sys.executable, "-m", "mlflow", "models", "serve", "-m", str(folder),
            "--env-manager", "local", "-h", host, "-p", str(port),
        ]  # fmt: skip
        # MLflow starts uvicorn from PATH: this environment's, wherever dpivon was run from
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        try:
            with signals_interrupt():  # SIGTERM too ends the server and removes the copy
                return subprocess.run(command, env={**os.environ, "PATH": path}).returncode
        except Interrupted as stop:
            return stop.exit_code


def load_scored_model(
    model_uri: str, tracking_uri: str | None = None, trust_code: bool = False
) -> tuple[TrainConfig, torch.nn.Module, Posterior | None]:
    """The config, mean model and posterior of a logged model (``runs:/RUN_ID/model``,
    ``models:/NAME/VERSION``, a model folder; its code checked as :func:`load_pyfunc` checks
    it) or of a model file as `dpivon.tracking.model_file` saves it (a sweep trial's
    ``model.pt``, committed weights), or one line saying why it cannot be loaded."""
    path = Path(model_uri).expanduser()
    if os.path.lexists(path) and not path.is_dir():
        return load_model_file(path)  # a file that is not one is refused in one line
    if ":/" not in model_uri and not path.exists():
        raise DpivonError(
            f"the model {model_uri} does not exist: give runs:/RUN_ID/model, "
            "models:/NAME/VERSION, a model folder or a model file (.pt)"
        )
    classifier = load_pyfunc(model_uri, tracking_uri, trust_code).unwrap_python_model()
    return classifier.config, classifier.model, classifier.posterior
