"""Cost of secure noise: a private step with secure noise against the same step in research mode.

Secure mode (the default) draws the DP noise and the Poisson mask from a ChaCha20 stream
keyed by the OS, four Gaussians per coordinate (Opacus's floating-point defence), made on
the training device in the parameters' dtype (OpenSSL's keystream on a CPU, the torch
ChaCha20 of `dpivon.privacy.chacha` elsewhere); research mode draws one Gaussian per
coordinate from a seeded torch generator on the device (`dpivon.privacy.noise`). For each
case (model, batch size) both configurations of an optimizer are built by
`build_training` and timed round-robin in one process, one step of each per round in a
shuffled order (`step_time.timed_step`: the batch is drawn before the clock starts, so the
step time holds the noise but not the mask), ms/step the median after warm-up. The ratio is
paired by round (the two modes' steps of one round saw the same load): the median of the
per-round ratios with a 95 % bootstrap interval (scipy.stats.bootstrap), so a difference
within the machine's jitter reads as one. The noise and the mask are also timed alone, the
noise in ns per coordinate of the model.

    python benchmarks/secure_noise.py            # tanh-cnn b256 and WRN-16-4 b64, CPU: minutes
    python benchmarks/secure_noise.py --cases tanh-cnn:1024 --steps 20 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from scipy.stats import bootstrap
from step_time import (
    build_run,
    round_robin_times,
    synchronize,
    synthetic_data,
)

from dpivon.logs import quiet_known_output
from dpivon.privacy.noise import SecureRandomness, SeededRandomness, gaussian_noise
from dpivon.process import allocator, configure_process, jemalloc_loaded, preload_jemalloc
from dpivon.runs import resolve_device

MODES = {"research": True, "secure": False}  # mode -> research_mode


def draw_ms(draw, device: torch.device, repeats: int) -> float:
    """Median milliseconds of one call of ``draw``."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        draw()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def paired_ratio(secure_ms: list[float], research_ms: list[float]) -> dict:
    """Median of the per-round secure / research ratios, with its 95 % percentile-bootstrap
    interval (the median's sampling distribution is not normal at tens of rounds)."""
    ratios = np.asarray(secure_ms) / np.asarray(research_ms)
    interval = bootstrap(
        (ratios,), np.median, confidence_level=0.95, method="percentile",
        random_state=np.random.default_rng(0),
    ).confidence_interval  # fmt: skip
    return {"ratio": float(np.median(ratios)), "ratio_low": float(interval.low),
            "ratio_high": float(interval.high)}  # fmt: skip


def measure_case(
    args: argparse.Namespace, model: str, batch_size: int, device: torch.device
) -> dict:
    """Step times of both modes per optimizer, and the noise and mask alone, for one case."""
    data = synthetic_data(batch_size)
    runs = {
        (optimizer, mode): build_run(
            optimizer, args.engine, model, batch_size, data, device, research
        )
        for optimizer in args.optimizers
        for mode, research in MODES.items()
    }
    times = round_robin_times(runs, args.warmup, args.steps)
    ms = {key: statistics.median(t) for key, t in times.items()}
    coordinates = sum(p.numel() for p in next(iter(runs.values())).setup.model.parameters())
    examples = len(data.train)
    sources = {"research": SeededRandomness(0, device), "secure": SecureRandomness()}
    repeats = max(args.steps, 5)
    noise_ns = {
        mode: draw_ms(lambda r=r: gaussian_noise(r, 1.0, coordinates, device), device, repeats)
        * 1e6
        / coordinates
        for mode, r in sources.items()
    }
    mask_ms = {
        mode: draw_ms(lambda r=r: r.uniform(examples, device), device, repeats)
        for mode, r in sources.items()
    }
    steps = [
        {"optimizer": optimizer, "research_ms": ms[(optimizer, "research")],
         "secure_ms": ms[(optimizer, "secure")],
         **paired_ratio(times[(optimizer, "secure")], times[(optimizer, "research")])}
        for optimizer in args.optimizers
    ]  # fmt: skip
    return {"model": model, "batch_size": batch_size, "coordinates": coordinates,
            "examples": examples, "steps": steps, "noise_ns_per_coordinate": noise_ns,
            "mask_ms": mask_ms}  # fmt: skip


def main() -> None:
    preload_jemalloc()
    quiet_known_output()
    configure_process()  # what `dpivon train`, sweep trials and benchmark runs apply
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", nargs="+", default=["tanh-cnn:256", "wrn-16-4:64"], help="model:batch_size"
    )
    parser.add_argument("--optimizers", nargs="+", default=["dp-ivon-gradsq", "dp-sgd"])
    parser.add_argument("--engine", default="bk")
    parser.add_argument("--steps", type=int, default=30, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    device = resolve_device(args.device)
    console = Console(width=120)
    console.print(f"allocator: {allocator()} (jemalloc loaded: {jemalloc_loaded()})")
    console.print(f"load average before: {os.getloadavg()}")

    cases = []
    for case in args.cases:
        model, batch_size = case.rsplit(":", 1)
        cases.append(measure_case(args, model, int(batch_size), device))
        console.print(f"{case} done, load average: {os.getloadavg()}")

    table = Table(
        title=f"secure / research step, engine {args.engine}, {device.type}, "
        f"{torch.get_num_threads()} threads"
    )
    columns = ("model", "batch", "optimizer", "research ms/step", "secure ms/step",
               "secure x research", "95 % interval")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in columns[:3] else "right")
    for case in cases:
        for row in case["steps"]:
            table.add_row(
                case["model"], str(case["batch_size"]), row["optimizer"],
                f"{row['research_ms']:.1f}", f"{row['secure_ms']:.1f}", f"{row['ratio']:.3f}",
                f"[{row['ratio_low']:.3f}, {row['ratio_high']:.3f}]",
            )  # fmt: skip
    console.print(table)
    for case in cases:
        noise, mask = case["noise_ns_per_coordinate"], case["mask_ms"]
        console.print(
            f"{case['model']}: noise alone ({case['coordinates']} coordinates) research "
            f"{noise['research']:.1f} ns, secure {noise['secure']:.1f} ns per coordinate; "
            f"Poisson mask ({case['examples']} examples): research {mask['research']:.2f} ms, "
            f"secure {mask['secure']:.2f} ms"
        )
    console.print(f"load average after: {os.getloadavg()}")
    if args.json is not None:
        figures = {"cases": cases, "device": device.type, "engine": args.engine}
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
