"""Whether the tuning predicted the final runs: the transfer check (how the picks' tuning
scores rank against their final test scores) and the known-setting check (each tuned pick
against a fixed, published setting of its optimizer, paired by seed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from dpivon.study.aggregate import SUMMARISED, seed_values
from dpivon.study.report_blocks import Block, Heading, Paragraph, TableBlock
from dpivon.study.report_numbers import difference_cells, difference_text
from dpivon.study.significance import (
    Difference,
    RankAgreement,
    rank_agreement,
    seed_difference,
    verdict_word,
)

TRANSFER_NOTE = (
    "Each tuned method's pick has a score in its tuning sweep (the sweep's first objective, "
    "on the validation split, at the tuning protocol's length and data) and a final score "
    "(the same metric on the test set, mean over seeds, at the benchmark's). The tuning "
    '"predicted" the final runs where Kendall\'s tau is positive at p < 0.05; with few '
    "picks only a near-perfect agreement is significant."
)


KNOWN_SETTING_NOTE = (
    "Each tuned method beside every method of the same optimizer at fixed hyper-parameters "
    "(those the benchmark file gives, such as a published setting, over the registry's "
    "defaults): test accuracy of the pick minus the fixed setting's, over the seeds. "
    '"leads": the tuning found a better setting for the final runs; "trails": it '
    "picked a worse one than the fixed setting."
)


def final_metric(tuning_metric: str) -> str:
    """The test metric a validation objective stands for (val_accuracy -> test_accuracy)."""
    return "test_" + tuning_metric.removeprefix("val_")


@dataclass(frozen=True)
class TransferCheck:
    """One epsilon's transfer check: the tuning metric, each pick's (tuning score, final
    mean over ``seeds``, the replicates every pick finished) and their rank agreement."""

    epsilon: float
    metric: str
    pairs: dict[str, tuple[float, float]]
    seeds: int
    agreement: RankAgreement


def transfer_checks(
    runs: pd.DataFrame, tuning_scores: dict[tuple[str, float], tuple[str, float]]
) -> list[TransferCheck]:
    """Per epsilon with tuned methods: each pick's tuning score against its final mean and
    the rank agreement of the two (larger-is-better for both). The final means are over the
    seeds that every pick finished, so that a benchmark under way ranks like for like."""
    checks = []
    for eps in sorted({e for _, e in tuning_scores}):
        picks = {m: score for (m, e), score in tuning_scores.items() if e == eps}
        metric = next(iter(picks.values()))[0]
        final = final_metric(metric)
        if final not in runs:
            continue
        at = runs[(runs["epsilon"] == eps) & runs["method"].isin(list(picks))]
        # one column per pick that has a finite value, one row per seed all of them have
        by_seed = at.pivot(index="replicate", columns="method", values=final)
        by_seed = by_seed.dropna(axis="columns", how="all").dropna()
        pairs = {m: (picks[m][1], float(v)) for m, v in by_seed.mean().items()}
        shared = len(by_seed)
        sign = -1.0 if SUMMARISED.get(final) == "min" else 1.0
        agreement = rank_agreement(
            {m: sign * t for m, (t, _) in pairs.items()},
            {m: sign * f for m, (_, f) in pairs.items()},
        )
        checks.append(TransferCheck(eps, metric, pairs, shared, agreement))
    return checks


def known_setting_pairs(method_configs: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(tuned method, fixed method) of the same optimizer: a sweep's pick beside fixed
    hyper-parameters (a published setting), whose final runs say whether the tuning paid."""
    tuned = [m for m, c in method_configs.items() if c.get("tuned_by")]
    fixed = [m for m, c in method_configs.items() if not c.get("tuned_by")]
    return [
        (t, f)
        for t in tuned
        for f in fixed
        if method_configs[t]["optimizer"] == method_configs[f]["optimizer"]
    ]


def known_setting_checks(
    runs: pd.DataFrame, pairs: Sequence[tuple[str, str]]
) -> list[tuple[float, str, str, Difference]]:
    """Per epsilon both ran at: (epsilon, tuned, fixed, test accuracy of tuned minus fixed
    over the seeds, paired where they share two or more)."""
    checks = []
    for tuned, fixed in pairs:
        for eps in sorted(set(runs["epsilon"])):
            picked = seed_values(runs, tuned, eps, "test_accuracy")
            known = seed_values(runs, fixed, eps, "test_accuracy")
            if picked and known:
                checks.append((eps, tuned, fixed, seed_difference(picked, known)))
    return checks


def known_setting_line(eps: float, tuned: str, fixed: str, d: Difference) -> str:
    """The verdict's sentence on whether a tuned pick beat its optimizer's fixed setting."""
    detail = difference_text(d, 100.0, 1, " points")
    said = {
        "leads": f"the tuned **{tuned}** leads {fixed}",
        "trails": f"the tuned {tuned} trails **{fixed}**",
        "indistinguishable": f"the tuned {tuned} and {fixed} are indistinguishable at "
        f"{d.seeds} seeds",
        "unknown": f"the tuned {tuned} against {fixed}",
    }[verdict_word(d, "max")]
    return (
        f"epsilon {eps:g}: {said} (the same optimizer at fixed hyper-parameters), test "
        f"accuracy {detail}."
    )


def transfer_line(eps: float, metric: str, agreement: RankAgreement) -> str:
    """The verdict's sentence on whether the tuning predicted the final ranking."""
    if agreement.word == "unknown":
        return (
            f"epsilon {eps:g}: {agreement.items} tuned pick(s): too few to say whether the "
            "tuning predicted the final runs."
        )
    said = {
        "predicted": "the tuning predicted the final ranking",
        "did not predict": "the tuning did not predict the final ranking",
        "agreed, not significantly": "the tuning's ranking agreed with the final one, not "
        "significantly",
    }[agreement.word]
    return (
        f"epsilon {eps:g}: {said} ({metric} in tuning against {final_metric(metric)} "
        f"over {agreement.items} picks: Spearman {agreement.spearman:.2f} (p = "
        f"{agreement.spearman_p:.2g}), Kendall {agreement.kendall:.2f} (p = "
        f"{agreement.kendall_p:.2g}))."
    )


def transfer_check_blocks(
    runs: pd.DataFrame, tuning_scores: dict[tuple[str, float], tuple[str, float]]
) -> list[Block]:
    """The report's section on the transfer check; none without tuned picks."""
    checks = transfer_checks(runs, tuning_scores)
    if not checks:
        return []
    blocks: list[Block] = [Heading("Did the tuning predict the final runs?")]
    for check in checks:
        final = final_metric(check.metric)
        rows = [
            [method, f"{tuning:.4f}", f"{value:.4f}"]
            for method, (tuning, value) in sorted(check.pairs.items(), key=lambda kv: -kv[1][0])
        ]
        seeds = f"mean of the {check.seeds} seed{'s' * (check.seeds != 1)} every pick ran"
        blocks += [
            Paragraph(transfer_line(check.epsilon, check.metric, check.agreement)),
            TableBlock(["method", f"{check.metric} (tuning)", f"{final} (final, {seeds})"], rows),
        ]
    return [*blocks, Paragraph(TRANSFER_NOTE)]


def known_setting_blocks(checks: Sequence[tuple[float, str, str, Difference]]) -> list[Block]:
    """The report's table of tuned picks against fixed settings of their optimizer."""
    header = ["eps", "tuned pick", "fixed setting", "accuracy difference (points)", "95 % CI",
              "p", "seeds", "verdict"]  # fmt: skip
    rows = [
        [f"{eps:g}", tuned, fixed, *difference_cells(d, 100.0, 1, verdict_word(d, "max"))]
        for eps, tuned, fixed, d in checks
    ]
    return [
        Heading("Tuned picks against fixed settings of their optimizer"),
        TableBlock(header, rows),
        Paragraph(KNOWN_SETTING_NOTE),
    ]
