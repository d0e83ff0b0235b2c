"""MLflow tracking, one module per concern: `client` (the `Tracker`: runs, metrics, tags,
artifacts by explicit run id), `model_file` (a trained model as one file) and
`served_model` (the posterior pyfunc model: raw images in, uncertainty out). What a
training run logs is the runs layer's (`dpivon.runs.tracked`). Import the submodules
directly; this package imports nothing.
"""
