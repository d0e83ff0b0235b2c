"""Config values against the memory this process may use: a size that passes the config's
static bound but not this machine is one line before any allocation or run, and every
numeric field, drawn at random and at its extremes, is refused or trains within a limit set
with ``setrlimit`` (`memory_probe.py`)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from memory_probe import BASE, TIME_ONLY, numeric_fields

from dpivon.config import parse_config
from dpivon.errors import DpivonError
from dpivon.runs import load_data, train

PYTHON = sys.executable
DPIVON = str(Path(PYTHON).parent / "dpivon")
PROBE = Path(__file__).with_name("memory_probe.py")
GIB = 1024**3


def limited_data(limit: int):
    """A child process whose data segment (heap, anonymous mappings) is at most ``limit``."""

    def apply() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))

    return apply


def test_synthetic_images_beyond_the_process_limit_are_one_line_before_any_run(tmp_path):
    # 1,000,000 images (and their test split: 18 GB) pass the config's bound but not a 6 GiB limit
    config = tmp_path / "big.yaml"
    config.write_text("data: {dataset: synthetic, synthetic_size: 1000000}\noptimizer: sgd\n")
    result = subprocess.run(
        [DPIVON, "train", "--config", str(config), "--epochs", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limited_data(6 * GIB),
        env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"},
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.synthetic_size=1,000,000 would need 1" in lines[0], lines
    assert "can allocate" in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_every_numeric_field_is_refused_or_trains_within_a_memory_limit():
    """300 Hypothesis examples over every optimizer's numeric fields, 2 GiB above what the
    probe's imports use. Its runs found a clip_radius beyond float32 crashing IVON's update
    (tests/test_optim.py keeps that case), and an lr of 3.4e37 and a fixed noise multiplier
    of 1e154 overflowing Adam and the accountant (now bounded: tests/test_input_errors.py)."""
    result = subprocess.run(
        [PYTHON, str(PROBE), str(2 * GIB), "300"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert len(lines) >= 250, lines  # one per example (Hypothesis may stop a few short)
    assert any(": refused: " in line for line in lines)
    assert any("trained within the limit" in line for line in lines)


# float32's edges and beyond, where a hyper-parameter that reaches a tensor op overflows
FLOAT_EDGES = (3.4e38, 3.5e38, 1e300, 1e-45, 5e-324)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", sorted(numeric_fields()))
def test_every_float_field_at_float32_s_edges_is_refused_or_trains(optimizer, one_thread):
    """Each numeric field of each optimizer at each edge value: refused in one line, or a
    run that trains (this found lr, weight_decay, hess_init, hess_floor, second_moment_floor,
    max_grad_norm and the fixed noise multiplier crashing with raw errors)."""
    for field in numeric_fields()[optimizer]:
        if field in TIME_ONLY:
            continue
        for value in FLOAT_EDGES:
            try:
                config = parse_config({**BASE, "optimizer": optimizer, field: value})
                train(config, data=load_data(config))
            except DpivonError as err:
                assert "\n" not in str(err).strip(), (field, value, str(err))
