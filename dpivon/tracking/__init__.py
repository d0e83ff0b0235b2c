"""MLflow tracking, one module per concern: `client` (the `Tracker`: runs, metrics, tags,
artifacts by explicit run id), `layout` (run kinds, shared tags, one outcome
vocabulary), `model_file` (a trained model as one file),
`served_model` (the posterior pyfunc model: raw images in, uncertainty out) and
`model_trust` (a model folder's loader and code checked before it loads). What a
training run logs is the runs layer's (`dpivon.runs.tracked`). Import the submodules
directly; this package imports nothing.
"""
