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

import base64
import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from dpivon.orchestration.storage import SweepStorage
from dpivon.study.aggregate import (
    Comparison,
    RunRecord,
    aggregate,
    compare,
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
from dpivon.tracking.client import Tracker

REPORT_MD = "report.md"
REPORT_HTML = "report.html"
FIGURES = "figures"
RESULTS_CSV = "results.csv"
RUNS_CSV = "runs.csv"
SPREAD_RULE = (
    '"Beyond the seeds\' spread" means the gap between the two means exceeds the sum of '
    "their standard deviations over seeds (the mean ± std intervals do not overlap); with "
    "3 seeds this is a screen, not a significance test."
)
TEMPERATURE_NOTE = (
    "NLL (TS) and ECE (TS) are after post-hoc temperature scaling (`dpivon.calibration`): "
    "one temperature T per run, fitted by NLL on the validation split's predictive and "
    "applied to the test predictive (accuracy is unchanged). It uses the validation records "
    "with exact scores, as the sweep does: they are held out from training, so the training "
    "epsilon does not cover them; a release would fit T on public data or privately."
)
COLUMN_NOTE = (
    "eps spent: the accountant's epsilon of the training (inf: no noise, clipping only); "
    "wall s: the time `train` took (training and per-epoch validation, not the final test "
    "evaluation); T: the fitted temperature (> 1 softens an over-confident predictive)."
)
# (column, header, scale, decimals) of the results table
_COLUMNS = (
    ("test_accuracy", "accuracy %", 100.0, 1),
    ("test_nll", "NLL", 1.0, 3),
    ("test_ece", "ECE", 1.0, 3),
    ("test_brier", "Brier", 1.0, 3),
    ("test_ts_nll", "NLL (TS)", 1.0, 3),
    ("test_ts_ece", "ECE (TS)", 1.0, 3),
    ("temperature", "T", 1.0, 2),
    ("epsilon_spent", "eps spent", 1.0, 2),
    ("wall_time_s", "wall s", 1.0, 0),
)
# (column, header, scale, decimals) of the last epoch's curvature diagnostics
_DIAGNOSTIC_COLUMNS = (
    ("last_projected_fraction", "projected fraction", 1.0, 3),
    ("last_clamped_noise_share_median", "clamped-noise share of h", 1.0, 3),
    ("last_hess_median", "median h", 1.0, 3),
    ("last_posterior_std_median", "median posterior std", 1.0, 4),
)
DIAGNOSTICS_NOTE = (
    "At the last epoch, mean ± std over seeds (`dpivon.optim.ivon.DPIVON` documents them): "
    "projected fraction, the epoch's mean share of coordinates whose noise-corrected v_hat "
    "was negative and projected to zero (the curvature collapse); clamped-noise share of h, "
    "the median over coordinates of the share of h that the clamped noise alone would give "
    "(near 1: h is no larger than noise makes it); median h and median posterior std "
    "s = 1/sqrt(ess (h + delta)) over all coordinates."
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


# --- blocks, rendered to Markdown and to HTML ----------------------------------------------


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Paragraph:
    text: str


@dataclass
class Bullets:
    items: list[str]


@dataclass
class TableBlock:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Images:
    """Figures side by side: file names (under figures/) with their PNG bytes."""

    names: list[str]
    caption: str = ""


Block = Heading | Paragraph | Bullets | TableBlock | Images


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _inline_html(text: str) -> str:
    """Escape, then the two inline marks the report uses: **bold** and `code`."""
    escaped = html.escape(text)
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", escaped)


_CSS = """
body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f2f2f2} td:first-child,th:first-child{text-align:left}
.images{display:flex;flex-wrap:wrap;gap:8px} .images img{max-width:100%}
figcaption{font-size:0.9em;color:#555}
code{background:#f4f4f4;padding:0 3px}
"""


@dataclass
class Report:
    """A built report: its blocks, figures (PNG bytes by file name) and numbers."""

    title: str
    blocks: list[Block]
    table: pd.DataFrame
    runs: pd.DataFrame
    verdict: list[str]
    figures: dict[str, bytes] = field(default_factory=dict)

    def results_markdown(self) -> str:
        return markdown_table(*results_rows(self.table))

    def note(self) -> str:
        """The parent run's description: verdict, rule and table, in Markdown."""
        verdict = "\n".join(f"- {line}" for line in self.verdict)
        return (
            f"**{self.title}**\n\n{verdict}\n\n{SPREAD_RULE}\n\n{self.results_markdown()}\n\n"
            f"Mean ± std over seeds. {TEMPERATURE_NOTE} Full report: artifact "
            f"`report/{REPORT_HTML}`."
        )

    def markdown(self) -> str:
        parts = [f"# {self.title}"]
        for block in self.blocks:
            if isinstance(block, Heading):
                parts.append("#" * block.level + " " + block.text)
            elif isinstance(block, Paragraph):
                parts.append(block.text)
            elif isinstance(block, Bullets):
                parts.append("\n".join(f"- {item}" for item in block.items))
            elif isinstance(block, TableBlock):
                parts.append(markdown_table(block.header, block.rows))
            else:
                images = " ".join(f"![{n}]({FIGURES}/{n})" for n in block.names)
                parts.append(images + (f"\n\n*{block.caption}*" if block.caption else ""))
        return "\n\n".join(parts) + "\n"

    def html(self) -> str:
        parts = [f"<h1>{html.escape(self.title)}</h1>"]
        for block in self.blocks:
            if isinstance(block, Heading):
                parts.append(f"<h{block.level}>{_inline_html(block.text)}</h{block.level}>")
            elif isinstance(block, Paragraph):
                parts.append(f"<p>{_inline_html(block.text)}</p>")
            elif isinstance(block, Bullets):
                items = "".join(f"<li>{_inline_html(item)}</li>" for item in block.items)
                parts.append(f"<ul>{items}</ul>")
            elif isinstance(block, TableBlock):
                head = "".join(f"<th>{_inline_html(h)}</th>" for h in block.header)
                body = "".join(
                    "<tr>" + "".join(f"<td>{_inline_html(c)}</td>" for c in row) + "</tr>"
                    for row in block.rows
                )
                parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
            else:
                images = "".join(
                    f'<img alt="{html.escape(n)}" src="data:image/png;base64,'
                    f'{base64.b64encode(self.figures[n]).decode()}">'
                    for n in block.names
                )
                caption = f"<figcaption>{_inline_html(block.caption)}</figcaption>"
                parts.append(f'<figure><div class="images">{images}</div>{caption}</figure>')
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(self.title)}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(parts)
            + "\n</body></html>\n"
        )


# --- numbers ---------------------------------------------------------------------------------


def mean_std(mean: float, std: float, scale: float = 1.0, decimals: int = 3) -> str:
    """``mean ± std`` (scaled); ``inf`` and missing values spelled out."""
    if math.isnan(mean):
        return "-"
    if math.isinf(mean):
        return "inf"
    text = f"{mean * scale:.{decimals}f}"
    return text if math.isnan(std) else f"{text} ± {std * scale:.{decimals}f}"


def results_rows(
    table: pd.DataFrame, columns: Sequence[tuple[str, str, float, int]] = _COLUMNS
) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a table of ``columns`` (mean ± std over seeds)."""
    header = ["method", "eps", "seeds", *(h for _, h, _, _ in columns)]
    rows = [
        [
            str(row["method"]),
            f"{row['epsilon']:g}",
            str(int(row["n"])),
            *(
                mean_std(row[f"{c}_mean"], row[f"{c}_std"], scale, decimals)
                for c, _, scale, decimals in columns
            ),
        ]
        for _, row in table.iterrows()
    ]
    return header, rows


def _comparison_text(
    c: Comparison | None, scale: float, decimals: int, unit: str, gap_words: str
) -> str | None:
    if c is None:
        return None
    best = f"**{c.best}** ({mean_std(c.best_mean, c.best_std, scale, decimals)}{unit})"
    if c.second is None:
        return f"{best}, the only method"
    spread = {
        True: "beyond the seeds' spread",
        False: "within the seeds' spread",
        None: "one seed: the spread is unknown",
    }[c.beyond_spread]
    second = f"{c.second} ({mean_std(c.second_mean, c.second_std, scale, decimals)}{unit})"
    return f"{best}, {c.gap * scale:.{decimals}f} {gap_words} {second}, {spread}"


def verdict_lines(table: pd.DataFrame) -> list[str]:
    """Per extreme epsilon: who has the best mean accuracy, NLL and ECE, and whether the
    margin over the runner-up exceeds the seeds' spread (see SPREAD_RULE); then, where runs
    logged curvature diagnostics, which method collapses least at the last epoch."""
    lines = []
    for eps in verdict_epsilons(table):
        accuracy = _comparison_text(
            compare(table, "test_accuracy", eps), 100.0, 1, " %", "points above"
        )
        nll = _comparison_text(compare(table, "test_nll", eps), 1.0, 3, "", "below")
        ece = _comparison_text(compare(table, "test_ece", eps), 1.0, 3, "", "below")
        lines.append(
            f"epsilon {eps:g}: best mean test accuracy {accuracy}; "
            f"lowest mean test NLL {nll}; lowest mean test ECE {ece}."
        )
        collapse = _comparison_text(
            compare(table, "last_projected_fraction", eps), 1.0, 3, "", "below"
        )
        if collapse is not None:
            lines.append(
                f"epsilon {eps:g}: least curvature collapse (lowest fraction of v_hat "
                f"projected to zero at the last epoch) {collapse}."
            )
    return lines


# --- the report ------------------------------------------------------------------------------


def _results_blocks(
    table: pd.DataFrame, verdict: list[str], settings: Sequence[str], failed: dict[str, str]
) -> list[Block]:
    """The settings, the verdict, the results table with its notes, the failed runs."""
    blocks: list[Block] = [Bullets(list(settings))] if settings else []
    blocks += [Heading("Verdict"), Bullets(verdict), Paragraph(SPREAD_RULE)]
    blocks += [
        Heading("Results (mean ± std over seeds)"),
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
    diagnosed = report.table[report.table["last_projected_fraction_mean"].notna()]
    if not diagnosed.empty:
        report.blocks += [
            TableBlock(*results_rows(diagnosed, _DIAGNOSTIC_COLUMNS)),
            Paragraph(DIAGNOSTICS_NOTE),
        ]
    report.figures["diagnostics.png"] = png_bytes(figure)
    with_diagnostics = {r.method for r in records if r.history}
    report.blocks.append(
        Images(
            ["diagnostics.png"],
            "Per-epoch values logged by training (`dpivon.optim.ivon.DPIVON`), mean over "
            "seeds; methods without them ("
            + ", ".join(m for m in methods if m not in with_diagnostics)
            + ") are not drawn.",
        )
    )


def _add_sweep_fronts(report: Report, sweeps: Sequence[SweepStorage]) -> None:
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
        rows.append([method, str(config["optimizer"]), shown, tuned_by])
    header = ["method", "optimizer", "hyper-parameters", "tuned by"]
    return [Heading("Methods"), TableBlock(header, rows)]


def build_report(
    title: str,
    records: Sequence[RunRecord],
    *,
    method_order: Sequence[str] | None = None,
    settings: Sequence[str] = (),
    method_configs: dict[str, dict[str, Any]] | None = None,
    sweeps: Sequence[SweepStorage] = (),
    failed: dict[str, str] | None = None,
) -> Report:
    """Aggregate ``records`` and lay out the report (figures rendered to PNG here).

    ``method_configs`` maps a method to one of its run configs (its hyper-parameters) and,
    under ``tuned_by``, where a sweep picked it; ``failed`` maps run keys to error lines.
    """
    methods = list(method_order or dict.fromkeys(r.method for r in records))
    table = aggregate(records, methods)
    verdict = verdict_lines(table) if not table.empty else ["no run finished"]
    blocks = _results_blocks(table, verdict, settings, failed or {})
    report = Report(title, blocks, table, records_frame(records), verdict)
    if table.empty:
        return report
    _add_metric_curves(report, methods)
    _add_reliability_diagrams(report, records, methods)
    _add_diagnostics(report, records, methods)
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
