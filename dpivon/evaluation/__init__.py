"""Scoring a trained model. Its predictive: at the posterior mean, or Bayesian model averaging
(BMA).

For the IVON family the predictive of record is BMA: over ``bma_samples`` posterior draws
(default 16; the IVON authors use up to 64, 16-64 is enough) for the final test and the
logged model, over ``val_bma_samples`` (default 4) for the per-epoch validation that the
sweep's objectives and ASHA read. The mean prediction is reported beside it. Other
optimizers have a point estimate only.

How evaluation runs is an `EvaluationPlan`: the batch size, the memory format and how many
posterior draws one call evaluates (a ``torch.func.vmap`` over stacked parameters, or one
draw after another), chosen per (device, model, threads) by a short measurement and cached
in dpivon's cache folder (`evaluation_plan`). Every forward runs under inference mode. The
plan changes how the numbers are computed, never which draws are taken.

- `posterior`: the posterior and its draws; `forward`: the plan and the forward passes;
- `plans`: measuring and caching the plan; `predictive`: the predictives and their scores;
- `weight_noise`: a point estimate averaged over isotropic weight noise (IVON's control);
- scoring: `metrics` (accuracy, NLL, ECE, Brier), `calibration` (temperature scaling),
  `prediction` (a table per image), `selective` (selective prediction, error detection),
  `shift` (all of them under dataset shift).
"""

from dpivon.evaluation.forward import EvaluationPlan, Params
from dpivon.evaluation.plans import PLAN_CACHE_FILE, evaluation_plan, measure_evaluation_plan
from dpivon.evaluation.posterior import Posterior, draw_parameters, posterior_draws
from dpivon.evaluation.predictive import (
    Evaluation,
    evaluate,
    evaluate_as_configured,
    predict_bma,
    predict_probs,
)
from dpivon.evaluation.weight_noise import (
    WeightNoiseChoice,
    choose_weight_noise,
    isotropic_posterior,
    weight_noise_posterior,
)

__all__ = [
    "PLAN_CACHE_FILE", "Evaluation", "EvaluationPlan", "Params", "Posterior",
    "WeightNoiseChoice", "choose_weight_noise", "draw_parameters", "evaluate",
    "evaluate_as_configured", "evaluation_plan", "isotropic_posterior",
    "measure_evaluation_plan", "posterior_draws", "predict_bma", "predict_probs",
    "weight_noise_posterior",
]  # fmt: skip
