"""Uncertainty under dataset shift: a model's predictive scored on clean test images and on
their CIFAR-10-C-style corruptions (`dpivon.data.corruptions`), severity by severity, as
Ovadia et al. ("Can you trust your model's uncertainty?", NeurIPS 2019) evaluate it.

Each set (clean = severity 0, then every corruption at every severity) gets the
classification metrics (`dpivon.evaluation.metrics`) and the selective-prediction and error-
detection ones (`dpivon.evaluation.selective`) for the scores max-probability, entropy and,
for a posterior predictive, mutual information. Every set is predicted with the same
posterior draws (one generator seed per set), so differences between severities are not draw
noise.

Two shift sets: ``default``, what a CPU affords per model (`DEFAULT_CORRUPTIONS`, one per
CIFAR-10-C family, on a class-stratified 500 of the 10,000 test images, all five
severities: 10,500 predictions with the clean set, times the posterior draws of the IVON
family), and ``full`` (the 19 corruptions on every test image: 960,000 predictions).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from dpivon.config import TrainConfig
from dpivon.data.arrays import ImageArrays, class_counts, stratified_indices
from dpivon.data.corruptions import (
    CORRUPTIONS,
    SEVERITIES,
    check_corruption,
    check_severity,
    load_corrupted,
)
from dpivon.data.images import model_input
from dpivon.errors import DpivonError
from dpivon.evaluation import Posterior
from dpivon.evaluation.metrics import classification_metrics, json_number
from dpivon.evaluation.prediction import Predictions, predict_with_uncertainty
from dpivon.evaluation.selective import selective_metrics

# One corruption of each CIFAR-10-C family (noise, blur, weather, digital), each cheap to
# make (under 2.5 ms an image here) and growing away from the clean image with severity.
DEFAULT_CORRUPTIONS = ("gaussian_noise", "defocus_blur", "fog", "contrast")
DEFAULT_PER_CLASS = 50
VALIDATION_SHIFT_METRICS = ("accuracy", "ece", "nll")  # a sweep's objectives val_shift_*
SHIFT_FILE = "shift.json"  # a run's artifact: every set's metrics (`ShiftResult.record`)
SUBSET_SEED = 0  # which test images the default set takes: fixed, so every model sees the same


@dataclass(frozen=True)
class ShiftSet:
    """Which corruptions, severities and test images (at most ``per_class`` of each class;
    None: every test image) a model is scored on."""

    corruptions: tuple[str, ...]
    severities: tuple[int, ...] = SEVERITIES
    per_class: int | None = DEFAULT_PER_CLASS


SHIFT_SETS: dict[str, ShiftSet] = {
    "default": ShiftSet(DEFAULT_CORRUPTIONS),
    "full": ShiftSet(tuple(CORRUPTIONS), per_class=None),
}


@dataclass
class ShiftResult:
    """One row of metrics per scored set: ``corruption`` ("none" for the clean images),
    ``severity`` (0 for clean) and the metrics; the images per set and where the time went
    (``corrupt_s``: making or reading the sets; ``predict_s``: the model, and
    ``predict_cpu_s`` the CPU seconds of its threads)."""

    rows: list[dict[str, float | int | str]]
    images: int
    seconds: dict[str, float] = field(default_factory=dict)

    def by_severity(self) -> dict[str, float]:
        """``shift_s<k>_<metric>``: the clean images' metrics for k = 0, the mean over the
        corruptions at severity k for k = 1..5 (Ovadia et al.'s summary per severity)."""
        out = {}
        for severity in sorted({int(row["severity"]) for row in self.rows}):
            rows = [row for row in self.rows if row["severity"] == severity]
            for metric in _metric_names(rows[0]):
                values = [float(row[metric]) for row in rows]
                out[f"shift_s{severity}_{metric}"] = float(np.mean(values))
        return out

    def record(self) -> dict:
        """JSON-ready: images per set, seconds, the means per severity and every set's row
        (NaN, an AUROC without a wrong or a right prediction, as null)."""
        return {
            "images": self.images,
            **{k: round(v, 3) for k, v in self.seconds.items()},
            **{k: json_number(v) for k, v in self.by_severity().items()},
            "sets": [{k: json_number(v) for k, v in row.items()} for row in self.rows],
        }


def _metric_names(row: dict) -> list[str]:
    return [k for k in row if k not in ("corruption", "severity")]


def check_shift_request(corruptions: tuple[str, ...], severities: tuple[int, ...]) -> None:
    """Unknown corruptions and severities outside 1-5 fail here, before any work."""
    for name in corruptions:
        check_corruption(name)
    for severity in severities:
        check_severity(severity)


def shift_images(test: ImageArrays, per_class: int | None) -> tuple[ImageArrays, np.ndarray]:
    """The clean images of a shift set and their keys (indices in ``test``): at most
    ``per_class`` of each class (all of a class that has fewer), drawn with `SUBSET_SEED`,
    or every image."""
    if per_class is None:
        return test, np.arange(len(test))
    if per_class < 1:
        raise DpivonError(f"a shift set takes at least 1 image per class, got {per_class}")
    counts = np.minimum(class_counts(test), per_class)
    keys = stratified_indices(test.labels, counts, np.random.default_rng(SUBSET_SEED))
    return test.take(keys), keys


def uncertainty_scores(predictions: Predictions) -> dict[str, np.ndarray]:
    """Per image, higher meaning less sure: ``maxprob`` (1 - the top probability),
    ``entropy`` and, for a posterior predictive, ``mi`` (mutual information)."""
    probs = predictions.probs.double()
    scores = {
        "maxprob": (1.0 - probs.max(dim=1).values).numpy(),
        "entropy": predictions.entropy.double().numpy(),
    }
    if predictions.mutual_information is not None:
        scores["mi"] = predictions.mutual_information.double().numpy()
    return scores


def score_predictions(predictions: Predictions, labels: Tensor, n_bins: int) -> dict[str, float]:
    """Accuracy, NLL, Brier and ECE, then AURC, accuracy at 90 % and 80 % coverage and the
    error-detection AUROC for each uncertainty score."""
    metrics = classification_metrics(predictions.probs, labels, n_bins)
    correct = (predictions.probs.argmax(dim=1) == labels).numpy()
    metrics.update(selective_metrics(uncertainty_scores(predictions), correct))
    return metrics


def evaluate_shift(
    model: nn.Module,
    posterior: Posterior | None,
    test: ImageArrays,
    shift_set: ShiftSet,
    *,
    bma_samples: int,
    seed: int,
    n_bins: int,
) -> ShiftResult:
    """Score the predictive (BMA over ``bma_samples`` draws with a posterior, else the point
    prediction) on the clean images of ``shift_set`` and on each corruption at each severity
    (made on first use, then read from the cache)."""
    check_shift_request(shift_set.corruptions, shift_set.severities)
    clean, keys = shift_images(test, shift_set.per_class)
    labels = torch.from_numpy(clean.labels)
    device = next(model.parameters()).device
    seconds = {"corrupt_s": 0.0, "predict_s": 0.0, "predict_cpu_s": 0.0}

    def score(images: np.ndarray) -> dict[str, float]:
        started, cpu_started = time.perf_counter(), time.process_time()
        generator = torch.Generator(device=device).manual_seed(seed)  # the same draws each set
        predictions = predict_with_uncertainty(
            model, posterior, model_input(images), bma_samples, generator=generator
        )
        seconds["predict_s"] += time.perf_counter() - started
        # on a shared machine the wall time depends on the neighbours; the CPU time less so
        seconds["predict_cpu_s"] += time.process_time() - cpu_started
        return score_predictions(predictions, labels, n_bins)

    rows: list[dict[str, float | int | str]] = [
        {"corruption": "none", "severity": 0, **score(clean.images)}
    ]
    for corruption in shift_set.corruptions:
        for severity in shift_set.severities:
            started = time.perf_counter()
            corrupted = load_corrupted(clean, keys, corruption, severity)
            seconds["corrupt_s"] += time.perf_counter() - started
            rows.append({"corruption": corruption, "severity": severity, **score(corrupted.images)})
    return ShiftResult(rows, len(clean), seconds)


def evaluate_shift_as_configured(
    config: TrainConfig,
    model: nn.Module,
    posterior: Posterior | None,
    test: ImageArrays | None,
    shift_set: ShiftSet,
) -> ShiftResult:
    """`evaluate_shift` as a run's ``config`` evaluates its test set: its BMA samples, ECE
    bins and seed."""
    if test is None:
        raise DpivonError("these data splits carry no test images to corrupt")
    return evaluate_shift(
        model,
        posterior,
        test,
        shift_set,
        bma_samples=config.evaluation.bma_samples,
        seed=config.runtime.seed,
        n_bins=config.evaluation.ece_bins,
    )


def validation_shift_scores(
    config: TrainConfig, val_images: ImageArrays | None, severity: int
) -> Callable[[nn.Module, Posterior | None], dict[str, float]]:
    """An epoch's scores under shift for a sweep's objectives: ``shift_accuracy``,
    ``shift_ece`` and ``shift_nll`` (`dpivon.runs` prefixes ``val_``), the means over
    `DEFAULT_CORRUPTIONS` at ``severity`` of the validation images (at most
    `DEFAULT_PER_CLASS` per class), with the per-epoch validation's posterior draws."""
    check_severity(severity)
    if val_images is None:
        raise DpivonError("these data splits carry no validation images to corrupt")
    shift_set = ShiftSet(DEFAULT_CORRUPTIONS, (severity,))

    def scores(model: nn.Module, posterior: Posterior | None) -> dict[str, float]:
        result = evaluate_shift(
            model,
            posterior,
            val_images,
            shift_set,
            bma_samples=config.evaluation.val_bma_samples,
            seed=config.runtime.seed,
            n_bins=config.evaluation.ece_bins,
        )
        means = result.by_severity()
        return {f"shift_{m}": means[f"shift_s{severity}_{m}"] for m in VALIDATION_SHIFT_METRICS}

    return scores
