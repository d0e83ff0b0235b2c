"""Empirical privacy audit in one training run.

m canaries are each included in the run with probability 1/2 (independent fair coins).
An included canary is one more training example, and it takes the data's path:

- it is a row of the Poisson sampler's population, so the sampler that draws the batches
  draws it, at the rate it really uses (not the accounted one);
- when drawn, it runs through the model with the batch, with its input to the last linear
  layer replaced by a crafted vector and a loss linear in one logit: its per-example
  gradient (norm 10 C, far outside the clip norm) is computed, normed and clipped by the
  engine with the data's, so it reaches the sum with norm C only if the engine clips
  with the norm it should;
- the noise and the division by the expected batch size follow, as for the data.

The auditor sees every privatised gradient g_dp (white box), projects it on each canary's
direction, and scores each canary by the likelihood ratio of those projections over the
steps (`CanaryExamples.scores`). Two analyses read the scores (`bound`): the mean shift of
the included canaries' scores in noise stds, a Gaussian-DP mu set against the accounted
mechanism's (tight, assuming the Gaussian shape that many subsampled Gaussian steps
approach), and the binomial bound of Steinke, Nasr & Jagielski (NeurIPS 2023) on the number
of correct guesses (valid for any mechanism, loose).

What it can see is what its canaries pass through: the sampler's rate, the engine's
per-example norms and clip, the noise's scale, the accountant's epsilon for that
mechanism. It cannot see a leak on a path they skip: the layers before the last (a
canary's input there is crafted), evaluation, logging or anything released outside the
training loop.

- `bound`: the analyses of the scores; `canaries`: the canaries as training examples;
- `run`: the audited run (through `dpivon.runs`' one training loop) and its control.
"""

from dpivon.audit.bound import (
    GaussianEstimate,
    GuessResult,
    audit_scores,
    clt_mu,
    correct_guesses,
    epsilon_lower_bound,
    gaussian_mu,
    gdp_delta,
    gdp_epsilon,
    guess_schedule,
    p_value,
)
from dpivon.audit.canaries import (
    CANARY_NORM_IN_CLIPS,
    Canaries,
    CanaryExamples,
    CanaryLoss,
    check_canary_count,
    last_linear,
    subsampled_gaussian_log_ratio,
)
from dpivon.audit.run import (
    AUDIT_DEFAULTS,
    NOISE_TOLERANCE,
    AuditResult,
    RunAudit,
    audit_config,
    check_audit,
    run_audit,
    scored_run,
)

__all__ = [
    "AUDIT_DEFAULTS", "CANARY_NORM_IN_CLIPS", "NOISE_TOLERANCE", "AuditResult", "Canaries",
    "CanaryExamples", "CanaryLoss", "GaussianEstimate", "GuessResult", "RunAudit",
    "audit_config", "audit_scores", "check_audit", "check_canary_count", "clt_mu",
    "correct_guesses", "epsilon_lower_bound", "gaussian_mu", "gdp_delta", "gdp_epsilon",
    "guess_schedule", "last_linear", "p_value", "run_audit", "scored_run",
    "subsampled_gaussian_log_ratio",
]  # fmt: skip
