"""Optimizers: IVON, DP-IVON-Gradsq and its ablations, DP-SGD/DP-Adam baselines."""

from dpivon.optim.ivon import DPIVON, IVON

__all__ = ["DPIVON", "IVON"]
