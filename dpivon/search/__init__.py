"""Hyper-parameter sweeps: search spaces (``space``), pipelines (``pipeline``), trials (``trial``).

Import the submodules directly; this package imports nothing so that loading a config stays
cheap (Ray and Optuna are imported only by the modules that run a sweep).
"""
