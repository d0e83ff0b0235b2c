"""Prune finished tuning sweeps to what this folder commits: each sweep's tables, fronts,
plot (PNG) and tuning quote, and the model file of every trial the benchmark picks (the
config `from_sweep` reads). Tune's resume state, the other checkpoints, the interactive
plot (5 MB of embedded plotly; `dpivon pareto` draws it again) and the private tuning facts
(``tuning_private.json``, never published) are deleted.

Run from the repo root once the sweeps have finished:
    .venv/bin/python results/compare-eps3/prune.py pipelines/compare-eps3.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

from dpivon.search.export import load_results
from dpivon.search.sweep import TUNE_EXPERIMENT
from dpivon.search.sweep_files import HTML_FILE, PRIVATE_TUNING_FILE
from dpivon.search.trial import MODEL_FILE
from dpivon.study.spec import load_benchmark


def main(benchmark_path: str) -> None:
    benchmark = load_benchmark(benchmark_path)
    picked = {run.tuned_by for run in benchmark.runs if run.tuned_by}  # sweep/group/trial
    for storage in benchmark.sweep_directories:
        folder = Path(storage.path)
        trials, _ = load_results(storage)
        kept = {
            trials.loc[trials["trial_id"] == tuned_by.rsplit("/", 1)[1], "checkpoint"].item()
            for tuned_by in picked
            if tuned_by.startswith(f"{storage.name}/")
        }
        keep = {folder / name / MODEL_FILE for name in kept}
        for path in sorted((folder / TUNE_EXPERIMENT).rglob("*"), reverse=True):
            if path.is_file() and path not in keep:
                path.unlink()
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        for name in (PRIVATE_TUNING_FILE, HTML_FILE):
            (folder / name).unlink(missing_ok=True)
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        print(f"{folder}: kept {len(keep)} picked model file(s), {size / 2**20:.1f} MB in all")
    load_benchmark(benchmark_path)  # what remains still gives every run its config


if __name__ == "__main__":
    main(sys.argv[1])
