"""MLflow tracking, one module per concern: `client` (the `Tracker`: runs, metrics, tags,
artifacts by explicit run id), `checkpoints` (a trained model as one file), `served_model`
(the posterior pyfunc model: raw images in, uncertainty out) and `training_run` (what a
finished training run logs). Import the submodules directly; this package imports nothing.
"""
