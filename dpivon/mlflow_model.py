"""MLflow "model from code" entry point: logged with every dpivon model, so loading one runs
this file instead of unpickling a Python object. It imports dpivon from the model's own
``code/`` folder (logged with it) unless the loading process has dpivon imported already."""

import mlflow

from dpivon.tracking.served_model import PosteriorClassifier

mlflow.models.set_model(PosteriorClassifier())
