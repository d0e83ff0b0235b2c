"""Per-image predictions with their uncertainty, as a deployed model returns them.

For the IVON family the predictive is BMA over ``samples`` posterior draws; its entropy
(total uncertainty) splits into the mean entropy of the draws (what each draw is unsure
of) and the mutual information between the label and the weights, H[E p] - E[H p]: how
much the draws disagree. A point prediction has its entropy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch
from torch import Tensor, nn

from dpivon.evaluation import Posterior, predict_bma, predict_probs


@dataclass(frozen=True)
class Predictions:
    """Predictive probabilities (N, classes), their entropy (N,) in nats and, for a
    posterior predictive, the mutual information (N,) across its draws."""

    probs: Tensor
    entropy: Tensor
    mutual_information: Tensor | None


def entropy(probs: Tensor) -> Tensor:
    """Shannon entropy in nats of each row, with 0 log 0 = 0."""
    return torch.special.entr(probs).sum(dim=1)


def predict_with_uncertainty(
    model: nn.Module,
    posterior: Posterior | None,
    images: Tensor,
    samples: int,
    *,
    generator: torch.Generator | None = None,
) -> Predictions:
    """BMA over ``samples`` draws with its entropy and mutual information; the point
    prediction and its entropy without a posterior or with ``samples`` 0.

    Each draw is one call of the evaluation's BMA with one sample on the same generator:
    the draws, and so the averaged probabilities, are those of ``predict_bma(samples)``."""
    if posterior is None or samples == 0:
        probs = predict_probs(model, images)
        return Predictions(probs, entropy(probs), None)
    total = draw_entropy = None
    for _ in range(samples):
        probs = predict_bma(model, posterior, images, 1, generator=generator)
        total = probs if total is None else total.add_(probs)
        draw_entropy = entropy(probs) if draw_entropy is None else draw_entropy + entropy(probs)
    bma = total / samples
    total_entropy = entropy(bma)
    # H[E p] >= E[H p] (concavity); the clamp only removes rounding below zero
    information = (total_entropy - draw_entropy / samples).clamp(min=0.0)
    return Predictions(bma, total_entropy, information)


def predictions_frame(predictions: Predictions, classes: tuple[str, ...]) -> pd.DataFrame:
    """One row per image: ``class`` (index), ``label`` (name), ``probability`` (of that
    class), ``entropy``, ``mutual_information`` (posterior predictives only) and
    ``prob_<label>`` for every class."""
    probs = predictions.probs.double()
    best = probs.argmax(dim=1)
    columns = {
        "class": best.numpy().astype("int64"),
        "label": [classes[i] for i in best.tolist()],
        "probability": probs.gather(1, best[:, None])[:, 0].numpy(),
        "entropy": predictions.entropy.double().numpy(),
    }
    if predictions.mutual_information is not None:
        columns["mutual_information"] = predictions.mutual_information.double().numpy()
    columns.update({f"prob_{name}": probs[:, i].numpy() for i, name in enumerate(classes)})
    return pd.DataFrame(columns)
