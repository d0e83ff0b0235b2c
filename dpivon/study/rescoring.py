"""Scores added to a benchmark's finished runs from their stored weights, without
retraining: uncertainty under shift where the pipeline asks for it after the runs ended, and
each point-estimate model averaged over isotropic weight noise (`weight_noise_scales`)."""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console

from dpivon.evaluation import (
    choose_weight_noise,
    evaluate_as_configured,
    weight_noise_posterior,
)
from dpivon.evaluation.shift import SHIFT_FILE, SHIFT_SETS, evaluate_shift_as_configured
from dpivon.optim.registry import IVONOptions
from dpivon.orchestration.storage import local_copy
from dpivon.runs import (
    load_data,
)
from dpivon.study.layout import (
    KEY_TAG,
    is_completed,
    weights_file,
)
from dpivon.study.spec import BenchmarkPipeline, RunSpec
from dpivon.tracking.client import Tracker
from dpivon.tracking.model_file import load_model_file

console = Console(stderr=True)


def stored_model(pipeline: BenchmarkPipeline, spec: RunSpec, scores: str) -> tuple | None:
    """(config, model, posterior) from a run's stored weights; None, with a note naming the
    ``scores`` only a rerun can give, where they are gone."""
    name = weights_file(spec.key)
    if not pipeline.storage.exists(name):
        console.print(
            f"[yellow]note:[/] {spec.key} has no stored weights ({name}); its {scores} "
            "need the run again",
            highlight=False,
        )
        return None
    with local_copy(pipeline.storage.location(name)) as path:
        return load_model_file(path)


def score_stored_weights_under_shift(
    pipeline: BenchmarkPipeline, tracker: Tracker, parent: str
) -> int:
    """The pipeline's ``shift`` scores of every completed run that lacks them (finished
    before the pipeline asked for them), from its stored weights: an evaluation, no
    retraining, logged on its run as training would have. Returns how many were scored; a
    run without stored weights is named (only a rerun can score it)."""
    shift_set = SHIFT_SETS.get(pipeline.shift)
    if shift_set is None:
        return 0
    existing = tracker.child_runs_by_tag(parent, KEY_TAG)
    todo = [
        (spec, existing[spec.key])
        for spec in pipeline.runs
        if spec.key in existing
        and is_completed(existing[spec.key])
        and not any(k.startswith("test_shift_") for k in existing[spec.key].data.metrics)
    ]
    test_images = load_data(todo[0][0].config).test_images if todo else None
    for number, (spec, run) in enumerate(todo, 1):
        if (stored := stored_model(pipeline, spec, "shift scores")) is None:
            continue
        config, model, posterior = stored
        shifted = evaluate_shift_as_configured(config, model, posterior, test_images, shift_set)
        scores = {f"test_{k}": v for k, v in shifted.by_severity().items()}
        tracker.log_metrics(run.info.run_id, scores, step=config.training.epochs)
        tracker.log_dict(run.info.run_id, shifted.record(), SHIFT_FILE)
        console.print(
            f"scored {spec.key} under shift ({number}/{len(todo)}) from {weights_file(spec.key)}: "
            f"{shifted.seconds.get('predict_cpu_s', float('nan')):.0f} CPU s",
            highlight=False,
        )
    return len(todo)


# A weight-noise average's shift scores: at severity 3 (the report's), beside the clean set.
WEIGHT_NOISE_SEVERITY = 3
WEIGHT_NOISE_FILE = "weight_noise.json"  # a run's artifact: each scale's validation NLL


def score_weight_noise_averaging(pipeline: BenchmarkPipeline, tracker: Tracker, parent: str) -> int:
    """For every completed point-estimate run not scored with them, the pipeline's
    ``weight_noise_scales`` scores from its stored weights (`dpivon.evaluation.weight_noise`):
    the scale the validation split prefers (``weight_noise_scale``, 0: none) and the test
    metrics of that average as ``test_wna_*`` (with the shift set, ``test_wna_shift_s3_*``).
    A run scored with other scales is scored again (its latest values are the report's).
    An evaluation, no retraining. Returns how many runs were scored."""
    if not pipeline.weight_noise_scales:
        return 0
    grid = {f"{s:g}" for s in (0.0, *pipeline.weight_noise_scales)}

    def scored(run) -> bool:
        if "weight_noise_scale" not in run.data.metrics:
            return False
        record = tracker.load_dict(run.info.run_id, WEIGHT_NOISE_FILE) or {}
        return set(record.get("validation_nll", {})) == grid

    existing = tracker.child_runs_by_tag(parent, KEY_TAG)
    todo = [
        (spec, existing[spec.key])
        for spec in pipeline.runs
        if spec.key in existing
        and is_completed(existing[spec.key])
        and not isinstance(spec.config.optimizer, IVONOptions)
        and not scored(existing[spec.key])
    ]
    data = load_data(todo[0][0].config) if todo else None
    shift_set = SHIFT_SETS.get(pipeline.shift)
    if shift_set is not None:
        shift_set = replace(shift_set, severities=(WEIGHT_NOISE_SEVERITY,))
    for number, (spec, run) in enumerate(todo, 1):
        if (stored := stored_model(pipeline, spec, "weight-noise scores")) is None:
            continue
        config, model, _ = stored
        choice = choose_weight_noise(config, model, data.val, pipeline.weight_noise_scales)
        posterior = weight_noise_posterior(model, choice.scale)
        test = evaluate_as_configured(config, model, data.test, posterior).metrics
        scores = {f"test_wna_{k}": test[k] for k in ("accuracy", "nll", "ece", "brier")}
        if shift_set is not None:
            shifted = evaluate_shift_as_configured(
                config, model, posterior, data.test_images, shift_set
            ).by_severity()
            at = f"shift_s{WEIGHT_NOISE_SEVERITY}"
            scores.update({f"test_wna_{at}_{k}": shifted[f"{at}_{k}"] for k in ("accuracy", "ece")})
        tracker.log_metrics(
            run.info.run_id,
            {**scores, "weight_noise_scale": choice.scale},
            step=config.training.epochs,
        )
        tracker.log_dict(
            run.info.run_id,
            {"validation_nll": {f"{s:g}": v for s, v in choice.validation_nll.items()}},
            WEIGHT_NOISE_FILE,
        )
        console.print(
            f"scored {spec.key} averaged over weight noise ({number}/{len(todo)}): scale "
            f"{choice.scale:g} of {', '.join(f'{s:g}' for s in choice.validation_nll)}",
            highlight=False,
        )
    return len(todo)
