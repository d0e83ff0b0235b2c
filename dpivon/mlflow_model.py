"""MLflow "model from code" entry point: logged with every dpivon model, so loading one runs
this file (importing the installed dpivon) instead of unpickling a Python object."""

import mlflow

from dpivon.tracking import PosteriorClassifier

mlflow.models.set_model(PosteriorClassifier())
