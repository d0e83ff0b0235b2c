"""Optimizers: IVON, DP-IVON-Gradsq and its ablations, DP-AdamBC (`ivon`, `adambc`), and the
registry of every optimizer a config can name (`registry`, importable without torch)."""
