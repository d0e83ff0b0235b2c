"""Cost of secure noise: a private step with secure noise against the same step in research mode.

Secure mode (the default) draws the DP noise and the Poisson mask from a ChaCha20 stream
keyed by the OS, four Gaussians per coordinate (Opacus's floating-point defence), made in
float64 on the CPU and moved to the device; research mode draws one Gaussian per coordinate
from a seeded torch generator on the device (`dpivon.privacy.noise`). Both configurations
of an optimizer are built by `build_training` and timed round-robin in one process, one
step of each per round (`step_time.timed_step`: the batch is drawn before the clock
starts, so the step time holds the noise but not the mask), ms/step the median after
warm-up. The mask and the noise are also timed alone, for the model's parameter count.

    python benchmarks/secure_noise.py                       # tanh-cnn, b256, CPU: minutes
    python benchmarks/secure_noise.py --optimizers dp-sgd --steps 20 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from step_time import (
    build_run,
    round_robin_medians,
    synchronize,
    synthetic_data,
)

from dpivon.logs import quiet_known_output
from dpivon.privacy.noise import SecureRandomness, SeededRandomness, gaussian_noise
from dpivon.process import allocator, configure_process, jemalloc_loaded, preload_jemalloc
from dpivon.training import resolve_device

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


def main() -> None:
    preload_jemalloc()
    quiet_known_output()
    configure_process()  # what `dpivon train`, sweep trials and benchmark runs apply
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tanh-cnn")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--optimizers", nargs="+", default=["dp-ivon-gradsq", "dp-sgd"])
    parser.add_argument("--engine", default="bk")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    device = resolve_device(args.device)
    console = Console(width=120)
    console.print(f"allocator: {allocator()} (jemalloc loaded: {jemalloc_loaded()})")
    console.print(f"load average before: {os.getloadavg()}")

    data = synthetic_data(args.batch_size)
    runs = {
        (optimizer, mode): build_run(
            optimizer, args.engine, args.model, args.batch_size, data, device, research
        )
        for optimizer in args.optimizers
        for mode, research in MODES.items()
    }
    ms = round_robin_medians(runs, args.warmup, args.steps)

    coordinates = sum(p.numel() for p in next(iter(runs.values())).setup.model.parameters())
    examples = len(data.train)
    sources = {"research": SeededRandomness(0, device), "secure": SecureRandomness()}
    repeats = max(args.steps, 5)
    noise_ms = {
        mode: draw_ms(lambda r=r: gaussian_noise(r, 1.0, coordinates, device), device, repeats)
        for mode, r in sources.items()
    }
    mask_ms = {
        mode: draw_ms(lambda r=r: r.uniform(examples, device), device, repeats)
        for mode, r in sources.items()
    }

    table = Table(
        title=f"{args.model}, batch {args.batch_size}, engine {args.engine}, {device.type}, "
        f"{torch.get_num_threads()} threads"
    )
    for column in ("optimizer", "research ms/step", "secure ms/step", "secure x research"):
        table.add_column(column, justify="left" if column == "optimizer" else "right")
    rows = []
    for optimizer in args.optimizers:
        research, secure = ms[(optimizer, "research")], ms[(optimizer, "secure")]
        table.add_row(optimizer, f"{research:.1f}", f"{secure:.1f}", f"{secure / research:.3f}")
        rows.append(
            {"optimizer": optimizer, "research_ms": research, "secure_ms": secure,
             "ratio": secure / research}
        )  # fmt: skip
    console.print(table)
    console.print(
        f"noise alone ({coordinates} coordinates): research {noise_ms['research']:.1f} ms, "
        f"secure {noise_ms['secure']:.1f} ms; Poisson mask ({examples} examples): research "
        f"{mask_ms['research']:.2f} ms, secure {mask_ms['secure']:.2f} ms"
    )
    console.print(f"load average after: {os.getloadavg()}")
    if args.json is not None:
        figures = {"steps": rows, "noise_ms": noise_ms, "mask_ms": mask_ms,
                   "coordinates": coordinates, "device": device.type}  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
