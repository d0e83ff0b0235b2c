"""The benchmark report's shift blocks (`dpivon.study.shift_report`) for the tuning picks'
committed weights, scored by `dpivon evaluate` (one JSON per method, beside this file):
each pick is one model, so the spread over seeds is unknown ("-")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from dpivon.study.aggregate import RunRecord
from dpivon.study.benchmark_report import FIGURES, Report
from dpivon.study.shift_report import add_shift_blocks

HERE = Path(__file__).resolve().parent
METHODS = ("dp-sgd", "dp-adam", "dp-ivon-gradsq", "dp-ivon-gradsq-mitigated")


def record(method: str) -> RunRecord:
    scored = json.loads((HERE / f"{method}.json").read_text())
    metrics = {f"test_{k}": v for k, v in scored.items() if k.startswith("shift_s")}
    return RunRecord(method, scored["optimizer"], 3.0, 0, metrics)


def main() -> None:
    methods = [m for m in METHODS if (HERE / f"{m}.json").is_file()]
    records = [record(m) for m in methods]
    report = Report("Tuning picks at epsilon 3 under shift", [], pd.DataFrame(), pd.DataFrame(), [])
    add_shift_blocks(report, records, methods)
    (HERE / FIGURES).mkdir(exist_ok=True)
    for name, data in report.figures.items():
        (HERE / FIGURES / name).write_bytes(data)
    (HERE / "report.md").write_text(report.markdown())
    print(f"wrote {HERE / 'report.md'} ({len(methods)} methods)", file=sys.stderr)


if __name__ == "__main__":
    main()
