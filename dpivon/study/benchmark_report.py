"""The benchmark report: one Markdown file and one self-contained HTML page.

Both render the same blocks (headings, paragraphs, tables, figures), so they never
disagree; the HTML embeds every figure as a base64 PNG and needs no other file, the
Markdown links the PNGs written beside it. The results table and the verdict are
also what the parent MLflow run's description (``mlflow.note.content``) shows.

Its figures (`dpivon.study.figures`): metrics versus epsilon, reliability diagrams at the
smallest and largest finite epsilon, the curvature-collapse diagnostics over training per
epsilon (whatever the runs logged; methods without them are left out of those panels, and
the last epoch's values are tabled), and the Pareto fronts of the sweeps the tuned methods
came from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from dpivon.evaluation.calibration import MIN_FIT_IMAGES
from dpivon.orchestration.storage import ResultsStorage
from dpivon.study.aggregate import (
    RunRecord,
    aggregate,
    records_frame,
    verdict_epsilons,
)
from dpivon.study.figures import (
    pareto_png,
    plot_diagnostics,
    plot_metric_curves,
    plot_pooled_reliability,
    png_bytes,
)
from dpivon.study.report_blocks import (
    FIGURES,
    Block,
    Bullets,
    Heading,
    Images,
    Paragraph,
    TableBlock,
    blocks_html,
    blocks_markdown,
    markdown_table,
)
from dpivon.study.report_numbers import (
    STATISTICS_RULE,
    difference_rows,
    results_rows,
    verdict_lines,
)
from dpivon.study.tuning_checks import (
    known_setting_blocks,
    known_setting_checks,
    known_setting_line,
    known_setting_pairs,
    transfer_check_blocks,
    transfer_checks,
    transfer_line,
)
from dpivon.tracking.client import Tracker

REPORT_MD = "report.md"
REPORT_HTML = "report.html"
RESULTS_CSV = "results.csv"
RUNS_CSV = "runs.csv"
TEMPERATURE_NOTE = (
    "NLL (TS) and ECE (TS) are after post-hoc temperature scaling "
    "(`dpivon.evaluation.calibration`): "
    "one temperature T per run, fitted by NLL on the validation split's predictive and "
    "applied to the test predictive (accuracy is unchanged). It uses the validation records "
    "with exact scores, as the sweep does: they are held out from training, so the training "
    "epsilon does not cover them; a release would fit T on public data or privately. "
    "No T where the validation split does not determine one (fewer than "
    f"{MIN_FIT_IMAGES} images, or its NLL still falling at T = 0.01 or 100)."
)
COLUMN_NOTE = (
    "eps spent: the accountant's epsilon of the training (inf: no noise, clipping only); "
    "eps end to end: that training composed (RDP, `dpivon.privacy.tuning."
    "compose_with_tuning`) with the tuning that chose a tuned method's settings on the same "
    "images, what its released model costs (a method at fixed hyper-parameters: its "
    "training's, its settings not chosen on these images); "
    "wall s: the run's wall time over every attempt (training, per-epoch validation, the "
    "test, the temperature fit and, with `shift`, the scoring under shift; a run scored under "
    "shift later from its stored weights leaves that out), beside the other runs in flight; "
    "T: the fitted temperature (> 1 softens an over-confident predictive)."
)
# (column, header, scale, decimals) of the last epoch's curvature diagnostics
_DIAGNOSTIC_COLUMNS = (
    ("last_projected_fraction", "projected fraction", 1.0, 3),
    ("last_clamped_noise_share_median", "clamped-noise share of h", 1.0, 3),
    ("last_hess_median", "median h", 1.0, 3),
    ("last_posterior_std_median", "median posterior std", 1.0, 4),
    ("last_curvature_horizon_share", "horizon share of h", 1.0, 3),
    ("last_curvature_learned_share_median", "learned share of h", 1.0, 3),
    ("last_curvature_update_share", "curvature's share of a step", 1.0, 3),
)
DIAGNOSTICS_NOTE = (
    "At the last epoch, mean [95 % interval] over seeds (`dpivon.optim.dp_ivon.DPIVON` documents "
    "them): "
    "projected fraction, the epoch's mean share of coordinates whose noise-corrected v_hat "
    "was negative and projected to zero (the curvature collapse); clamped-noise share of h, "
    "the median over coordinates of the share of h that the clamped noise alone would give "
    "(near 1: h is no larger than noise makes it); median h and median posterior std "
    "s = 1/sqrt(ess (h + delta)) over all coordinates. Whether h learned at all: horizon "
    "share of h, 1 - beta2^T after T steps, the most of h the estimates can have made (the "
    "rest is hess_init decayed); learned share of h, the median over coordinates of "
    "1 - hess_init beta2^T / h, what they made (0 for a frozen h, near 0 where the estimates "
    "collapse to 0); curvature's share of a step, ||step - step_0|| / ||step|| with step_0 "
    "the step at h = hess_init (the epoch's mean). A dash: a private-only diagnostic."
)
_HYPER_PARAMETERS = (
    "lr",
    "batch_size",
    "max_grad_norm",
    "momentum",
    "beta2",
    "hess_init",
    "weight_decay",
    "curvature_estimator",
    "curvature_ema",
    "curvature_pool",
    "hess_floor",
    "second_moment_floor",
    "lr_schedule",
    "bma_samples",
)


@dataclass
class Report:
    """A built report: its blocks, figures (PNG bytes by file name) and numbers."""

    title: str
    blocks: list[Block]
    table: pd.DataFrame
    runs: pd.DataFrame
    verdict: list[str]
    figures: dict[str, bytes] = field(default_factory=dict)
    privacy: list[str] = field(default_factory=list)  # see privacy_lines

    def add_verdict(self, lines: Sequence[str]) -> None:
        """More verdict lines; the Verdict block lists ``verdict`` itself (the same list,
        see `_results_blocks`), so they show wherever the report is rendered."""
        self.verdict.extend(lines)

    def results_markdown(self) -> str:
        return markdown_table(*results_rows(self.table))

    def note(self) -> str:
        """The parent run's description: the two epsilons, verdict, rule and table, in
        Markdown."""
        privacy = "".join(f"- {line}\n" for line in self.privacy)
        verdict = "\n".join(f"- {line}" for line in self.verdict)
        return (
            f"**{self.title}**\n\n{privacy}\n{verdict}\n\n{STATISTICS_RULE}\n\n{self.results_markdown()}\n\n"
            f"Mean [95 % interval] over seeds. {TEMPERATURE_NOTE} Full report: artifact "
            f"`report/{REPORT_HTML}`."
        )

    def markdown(self) -> str:
        return blocks_markdown(self.title, self.blocks)

    def html(self) -> str:
        return blocks_html(self.title, self.blocks, self.figures)


# --- the report ------------------------------------------------------------------------------


def _epsilon_text(value: float) -> str:
    return f"{value:,.2f}" if math.isfinite(value) else "inf"


def privacy_lines(table: pd.DataFrame, touched: Mapping[tuple[str, float], str]) -> list[str]:
    """The report's headline on privacy: per epsilon with tuned methods, what their released
    models spend end to end against what their training spent; then the rows of the results
    table with their two epsilons side by side, with what the tuning behind a tuned one
    touched (``touched``: (method, epsilon) -> `dpivon.runs.result.tuning_touched`). Rows
    that would say the same are one line (the parent run's description has a length limit)."""
    said: dict[str, list[str]] = {}  # a line's text after the methods -> its methods
    tuned: dict[float, list[float]] = {}  # epsilon -> its tuned methods' end-to-end epsilons
    for _, row in table.iterrows():
        method, eps = row["method"], row["epsilon"]
        spent, end_to_end = row["epsilon_spent_mean"], row["epsilon_end_to_end_mean"]
        if math.isinf(spent):
            said.setdefault(": not private (no noise), epsilon inf.", []).append(method)
            continue
        if (method, eps) in touched:
            tuned.setdefault(eps, []).append(end_to_end)
        how = touched.get((method, eps), "fixed hyper-parameters, not chosen on these images")
        text = (
            f" (epsilon {eps:g}): training {_epsilon_text(spent)}, end to end "
            f"{_epsilon_text(end_to_end)}; {how}."
        )
        said.setdefault(text, []).append(method)
    headline = []
    for eps, values in sorted(tuned.items()):
        low, high = min(values), max(values)
        spread = _epsilon_text(low) + ("" if low == high else f" to {_epsilon_text(high)}")
        headline.append(
            f"**Epsilon {eps:g} is what each run's training spent.** The tuned methods' "
            f"settings were chosen by tuning on the same training images, so their released "
            f"models spend epsilon {spread} end to end (that tuning composed with the "
            "training by the RDP accountant)."
        )
    rows = [", ".join(f"**{m}**" for m in methods) + text for text, methods in said.items()]
    return headline + rows


def _results_blocks(
    table: pd.DataFrame,
    verdict: list[str],
    settings: Sequence[str],
    failed: dict[str, str],
    privacy: list[str],
) -> list[Block]:
    """The settings, the two epsilons, the verdict, the results table with its notes, the
    failed runs."""
    blocks: list[Block] = [Bullets(list(settings))] if settings else []
    if privacy:
        heading = Heading("Privacy: each run's training and its end-to-end epsilon")
        blocks += [heading, Bullets(privacy)]
    # the report's own list, not a copy: Report.add_verdict adds to what this block shows
    blocks += [Heading("Verdict"), Bullets(verdict), Paragraph(STATISTICS_RULE)]
    blocks += [
        Heading("Results (mean [95 % interval] over seeds)"),
        TableBlock(*results_rows(table)),
        Paragraph(TEMPERATURE_NOTE),
        Paragraph(COLUMN_NOTE),
    ]
    if failed:
        blocks += [
            Paragraph(f"{len(failed)} run(s) failed and are not in the table:"),
            Bullets([f"`{key}`: {message}" for key, message in failed.items()]),
        ]
    return blocks


def _add_metric_curves(report: Report, methods: Sequence[str]) -> None:
    report.figures["metrics_vs_epsilon.png"] = png_bytes(plot_metric_curves(report.table, methods))
    report.blocks += [
        Heading("Metrics versus epsilon"),
        Images(["metrics_vs_epsilon.png"], "Mean over seeds, error bars one std; inf: no noise."),
    ]


def _add_reliability_diagrams(
    report: Report, records: Sequence[RunRecord], methods: Sequence[str]
) -> None:
    """One diagram per method, seeds pooled, at the smallest and largest finite epsilon."""
    report.blocks.append(Heading("Reliability diagrams (test, seeds pooled)"))
    finite = sorted({r.epsilon for r in records if math.isfinite(r.epsilon)})
    for eps in sorted({finite[0], finite[-1]}) if finite else []:
        names = []
        for method in methods:
            diagrams = [
                r.reliability
                for r in records
                if r.method == method and r.epsilon == eps and r.reliability is not None
            ]
            if not diagrams:
                continue
            name = f"reliability_{method}_eps{eps:g}.png"
            title = f"{method}, epsilon {eps:g} ({len(diagrams)} seeds)"
            report.figures[name] = png_bytes(plot_pooled_reliability(diagrams, title))
            names.append(name)
        if names:
            report.blocks.append(Images(names, f"epsilon {eps:g}"))


def _add_diagnostics(report: Report, records: Sequence[RunRecord], methods: Sequence[str]) -> None:
    report.blocks.append(Heading("Curvature-collapse diagnostics over training"))
    figure = plot_diagnostics(records, methods)
    if figure is None:
        report.blocks.append(
            Paragraph("No run logged curvature diagnostics (no IVON-family method).")
        )
        return
    diagnosed = report.table[report.table["last_hess_median_mean"].notna()]
    if not diagnosed.empty:
        report.blocks += [
            TableBlock(*results_rows(diagnosed, _DIAGNOSTIC_COLUMNS)),
            Paragraph(DIAGNOSTICS_NOTE),
        ]
    report.figures["diagnostics.png"] = png_bytes(figure)
    with_diagnostics = {r.method for r in records if r.history}
    without = [m for m in methods if m in {r.method for r in records} - with_diagnostics]
    caption = "Per-epoch values logged by training (`dpivon.optim.dp_ivon.DPIVON`), mean over seeds"
    if without:
        caption += f"; methods without them ({', '.join(without)}) are not drawn"
    report.blocks.append(Images(["diagnostics.png"], caption + "."))


def _add_sweep_fronts(report: Report, sweeps: Sequence[ResultsStorage]) -> None:
    report.blocks.append(Heading("Pareto fronts of the tuning sweeps (validation)"))
    for directory in sweeps:
        name = f"pareto_{directory.name}.png"
        report.figures[name] = pareto_png(directory)
        report.blocks.append(Images([name], f"sweep {directory.name}"))


def _methods_blocks(
    methods: Sequence[str], method_configs: dict[str, dict[str, Any]]
) -> list[Block]:
    """Each method's optimizer, hyper-parameters and where a sweep picked them."""
    rows = []
    for method in methods:
        config = method_configs.get(method)
        if config is None:
            continue
        shown = ", ".join(
            f"{k}={config[k]}" for k in _HYPER_PARAMETERS if config.get(k) is not None
        )
        tuned_by = config.get("tuned_by") or "fixed hyper-parameters"
        dimension = config.get("space_dimension")
        searched = (
            "-"
            if not config.get("tuned_by")
            else ("not recorded" if dimension is None else str(dimension))
        )
        rows.append([method, str(config["optimizer"]), shown, tuned_by, searched])
    header = ["method", "optimizer", "hyper-parameters", "tuned by", "space dimension"]
    return [Heading("Methods"), TableBlock(header, rows)]


def build_report(
    title: str,
    records: Sequence[RunRecord],
    *,
    method_order: Sequence[str] | None = None,
    settings: Sequence[str] = (),
    method_configs: dict[str, dict[str, Any]] | None = None,
    sweeps: Sequence[ResultsStorage] = (),
    failed: dict[str, str] | None = None,
    tuning_scores: dict[tuple[str, float], tuple[str, float]] | None = None,
    tuning_touched: Mapping[tuple[str, float], str] | None = None,
) -> Report:
    """Aggregate ``records`` and lay out the report (figures rendered to PNG here).

    ``method_configs`` maps a method to one of its run configs (its hyper-parameters) and,
    under ``tuned_by``, where a sweep picked it; ``failed`` maps run keys to error lines;
    ``tuning_scores`` maps (method, epsilon) to its pick's (metric, score) in the sweep,
    for the transfer check (its verdict lines join the verdict); ``tuning_touched`` maps
    (method, epsilon) of a tuned method to what its tuning touched (see `privacy_lines`).
    """
    methods = list(method_order or dict.fromkeys(r.method for r in records))
    table = aggregate(records, methods)
    runs = records_frame(records)
    verdict = verdict_lines(runs) if not table.empty else ["no run finished"]
    if not table.empty and tuning_scores:
        verdict += [
            transfer_line(check.epsilon, check.metric, check.agreement)
            for check in transfer_checks(runs, tuning_scores)
        ]
    known = known_setting_checks(runs, known_setting_pairs(method_configs or {}))
    extremes = set(verdict_epsilons(runs))
    verdict += [known_setting_line(*check) for check in known if check[0] in extremes]
    privacy = privacy_lines(table, tuning_touched or {})
    blocks = _results_blocks(table, verdict, settings, failed or {}, privacy)
    report = Report(title, blocks, table, runs, verdict, privacy=privacy)
    if table.empty:
        return report
    differences = difference_rows(runs, methods)
    if differences[1]:
        report.blocks += [
            Heading("Paired differences against the best method (test)"),
            TableBlock(*differences),
            Paragraph(STATISTICS_RULE),
        ]
    _add_metric_curves(report, methods)
    _add_reliability_diagrams(report, records, methods)
    _add_diagnostics(report, records, methods)
    if tuning_scores:
        report.blocks += transfer_check_blocks(report.runs, tuning_scores)
    if known:
        report.blocks += known_setting_blocks(known)
    if sweeps:
        _add_sweep_fronts(report, sweeps)
    if method_configs:
        report.blocks += _methods_blocks(methods, method_configs)
    return report


def write_report(report: Report, directory: Path) -> list[Path]:
    """report.md, report.html, the figures and the two CSV tables under ``directory``."""
    figures = directory / FIGURES
    figures.mkdir(parents=True, exist_ok=True)
    (directory / REPORT_MD).write_text(report.markdown())
    (directory / REPORT_HTML).write_text(report.html())
    report.table.to_csv(directory / RESULTS_CSV, index=False)
    report.runs.to_csv(directory / RUNS_CSV, index=False)
    written = [directory / name for name in (REPORT_MD, REPORT_HTML, RESULTS_CSV, RUNS_CSV)]
    for name, data in report.figures.items():
        (figures / name).write_bytes(data)
        written.append(figures / name)
    return written


def log_report(tracker: Tracker, run_id: str, report: Report, files: Sequence[Path]) -> None:
    """The report's files under ``report/``, the aggregated means as metrics, and the table
    with the verdict as the run's description."""
    for path in files:
        sub = f"report/{FIGURES}" if path.parent.name == FIGURES else "report"
        tracker.log_artifact(run_id, path, sub)
    metrics = {}
    for _, row in report.table.iterrows():
        for metric in ("test_accuracy", "test_nll", "test_ece", "test_ts_ece"):
            value = row[f"{metric}_mean"]
            metrics[f"{metric}.eps{row['epsilon']:g}.{row['method']}"] = value
    tracker.log_changed_metrics(run_id, metrics)  # a rebuilt report (--resume) adds none
    tracker.set_tags(run_id, {"mlflow.note.content": report.note()})
