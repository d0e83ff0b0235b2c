"""What a run may release: the metrics its epsilon covers, and resumable state without the
noise key. One home for the rule, which the CLI, trials and benchmark runs all apply."""

from __future__ import annotations

from dpivon.config import TrainConfig
from dpivon.privacy.noise import without_key

# Metrics computed on raw training batches: a private run's epsilon does not cover them.
NOT_COVERED_METRICS = ("train_loss",)


def released_metrics(
    config: TrainConfig, metrics: dict[str, float], *, train_loss: bool = False
) -> dict[str, float]:
    """What a run logs of one epoch's ``metrics``: a private run's raw training loss only
    when asked (``train_loss``; the caller marks it as not covered by the run's epsilon)."""
    if not config.is_private or train_loss:
        return dict(metrics)
    return {k: v for k, v in metrics.items() if k not in NOT_COVERED_METRICS}


def releasable_state(config: TrainConfig, state: dict) -> dict:
    """A training ``state`` (`EpochReport.checkpoint`) that may be stored where the run's
    releases are. Model, optimizer and accountant states are outputs of the private
    mechanism (post-processing of the noised gradients; DP-SGD's guarantee covers every
    iterate) and the torch generators draw only initialisation and posterior samples; what
    remains private is dropped: the noise key (the resumed run continues under a fresh one)
    and the history's metrics that the run's epsilon does not cover."""
    rng = {**state["rng"], "randomness": without_key(state["rng"]["randomness"])}
    history = [released_metrics(config, metrics) for metrics in state["history"]]
    return {**state, "rng": rng, "history": history}
