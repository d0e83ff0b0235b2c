"""What a noise-faithful tuning trial costs against the final run it stands for.

For each method of a noise-faithful tuning pipeline (default
``pipelines/compare-eps3-tan-tuning.yaml``), in one process and interleaved, this times
``--steps`` optimizer steps and one validation pass of the final run's config (batch B,
the method's start point) and of a trial's (batch B / k, sigma / k), with the training code
users run (`dpivon.runs.train`, its phase clock). It projects both over the whole run:

    final = S * step(B) + epochs * validation(final) + test
    trial = S * step(B / k) + trial_epochs * validation(trial)

(S: the target's steps; the test pass counted as one more validation of the final run) and
prints the trial / final ratio: the fraction of a final run one tuning trial costs, the
figure the study plans its compute with. Wall times on a shared machine are inflated; the
ratio compares two configs measured side by side. The load average is printed.

    python benchmarks/tan_cost.py                      # tanh-cnn, full CIFAR-10, 11 steps
    python benchmarks/tan_cost.py --pipeline pipelines/compare-eps1-tan-tuning.yaml
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from rich.console import Console
from rich.table import Table

from dpivon.config import parse_config
from dpivon.runs import PhaseTimes, load_data, train
from dpivon.search.pipeline import load_pipeline


def timed(config, data) -> tuple[float, float]:
    """(seconds per optimizer step, seconds per validation pass) of one short epoch."""
    phases = PhaseTimes()
    train(config, data=data, evaluate_test=False, phases=phases)
    steps = config.training.steps_per_epoch
    return (phases.seconds["train"] + phases.seconds["data"]) / steps, phases.seconds["validation"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline", default="pipelines/compare-eps3-tan-tuning.yaml")
    parser.add_argument("--steps", type=int, default=11, help="steps timed per config")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a trial's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # a benchmark script: its process, its setting
    pipeline = load_pipeline(args.pipeline)
    budget = pipeline.epsilon_list[0]
    console = Console()
    console.print(f"load average before: {os.getloadavg()}")
    data = None
    table = Table(title=f"{pipeline.name}: one trial against its final run (projected)")
    for column in (
        "method",
        "step B s",
        "step B/k s",
        "val final s",
        "val trial s",
        "final min",
        "trial min",
        "trial / final",
    ):
        table.add_column(column, justify="left" if column == "method" else "right")
    for name, space in pipeline.spaces.items():
        point = space.trial_config(dict(space.start_points[0])) if space.start_points else {}
        trial_keys = {**pipeline.base_train_config(name, budget), **point}
        final_keys = {
            **pipeline.owned_settings(name, budget),
            **pipeline.train,
            **point,
        }
        short = {"epochs": 1, "steps_per_epoch": args.steps}
        trial = parse_config({**trial_keys, **short})
        final = parse_config({**final_keys, **short})
        data = data if data is not None else load_data(final)
        target_steps = pipeline.epochs * -(-pipeline.data.train_size // final.training.batch_size)
        started = time.perf_counter()
        step_final, val_final = timed(final, data)
        step_trial, val_trial = timed(trial, data)
        final_s = target_steps * step_final + (pipeline.epochs + 1) * val_final
        trial_s = target_steps * step_trial + pipeline.trial_epochs * val_trial
        table.add_row(
            name,
            f"{step_final:.2f}",
            f"{step_trial:.2f}",
            f"{val_final:.1f}",
            f"{val_trial:.1f}",
            f"{final_s / 60:.0f}",
            f"{trial_s / 60:.1f}",
            f"{trial_s / final_s:.3f}",
        )
        console.print(f"{name}: measured in {time.perf_counter() - started:.0f} s")
    console.print(table)
    console.print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
