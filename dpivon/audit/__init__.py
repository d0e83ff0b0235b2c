"""Empirical privacy audit in one training run (Steinke, Nasr & Jagielski, NeurIPS 2023).

m gradient canaries are each included in the run with probability 1/2 (independent fair
coins). An included canary is one more training example, and it takes the data's path:

- it is a row of the Poisson sampler's population, so the sampler that draws the batches
  draws it, at the rate it really uses (not the accounted one);
- when drawn, its gradient (norm 10 C, above the clip norm) joins the batch's per-example
  gradients *before* the engine clips them, so it reaches the sum with norm C only if the
  engine clips;
- the noise and the division by the expected batch size follow, as for the data.

The auditor sees every privatised gradient g_dp (white box), scores each canary by the
likelihood ratio of its coordinate's values over the steps (`CanaryExamples.scores`),
guesses "included" for the top k+ scores and "excluded" for the bottom k-, and counts its
correct guesses. If the run is (eps, delta)-DP, that count is (up to a delta term)
stochastically dominated by Binomial(r, e^eps / (1 + e^eps)) for r guesses, so a count too
large for that binomial rejects eps: the largest eps rejected at the chosen
confidence is an empirical lower bound on the run's epsilon.

What it can see is what its canaries pass through: the sampler's rate, the engine's clip,
the noise's scale, the accountant's epsilon for that mechanism. It cannot see a leak on a
path they skip: the model's forward pass (canary gradients are injected, not computed),
evaluation, logging or anything released outside the training loop.

A maintained implementation of the bound exists only inside a JAX package (jax_privacy's
``auditing.CanaryScoreAuditor``), so it is written here with numpy; the tests check it
against an exact rational computation and the perfect-attacker numbers.

- `bound`: the bound from the scores; `canaries`: the canaries as training examples;
- `run`: the audited run (through `dpivon.runs`' one training loop) and its control.
"""

from dpivon.audit.bound import (
    GuessResult,
    audit_scores,
    correct_guesses,
    epsilon_lower_bound,
    guess_schedule,
    p_value,
)
from dpivon.audit.canaries import (
    CANARY_NORM_IN_CLIPS,
    Canaries,
    CanaryExamples,
    check_canary_count,
    dirac_sum,
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
    "CanaryExamples", "GuessResult", "RunAudit", "audit_config", "audit_scores", "check_audit",
    "check_canary_count", "correct_guesses", "dirac_sum", "epsilon_lower_bound",
    "guess_schedule", "p_value", "run_audit", "scored_run", "subsampled_gaussian_log_ratio",
]  # fmt: skip
