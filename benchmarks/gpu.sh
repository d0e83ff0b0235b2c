#!/usr/bin/env bash
# One short, prepared benchmark run for a lent GPU (about 10 minutes on one H200-class GPU,
# plus the trials: 12 `dpivon train` runs).
#
# Runs the CUDA cases of the secure-noise tests and benchmarks/secure_noise.py (secure /
# research step ratio, noise ns per coordinate; $OUT/secure-noise.json). Prints the
# step-time table of benchmarks/step_time.py (every private optimizer x engine
# bk, hooks, functorch, ghost, against non-private Adam; tanh-cnn and wrn-16-4; batch 256
# and 1024; peak memory from torch.cuda.max_memory_allocated) and the end-to-end time of
# one CIFAR-10 epoch (data, training, validation and test evaluation) of tanh-cnn and
# wrn-16-4, and writes all rows as JSON to $OUT/gpu.json; then the whole-trial tables of
# benchmarks/trial_time.py (`dpivon train` for adam, dp-adam and dp-ivon-gradsq, interleaved,
# the per-phase split and the ratios to dp-adam) on the quickstart subset (4,000 images,
# 2 epochs) and on full CIFAR-10 (1 epoch), as $OUT/trial-4k.json and $OUT/trial-full.json.
#
#   DPIVON_DATA=/path/to/cifar10-jpeg.tar.gz bash benchmarks/gpu.sh
#
# Knobs: PYTHON (default .venv/bin/python, else python), OUT (default benchmarks/out),
# STEPS (timed rounds, default 10), WARMUP (default 3), REPEATS (trial rounds, default 2).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python
OUT=${OUT:-benchmarks/out}
: "${DPIVON_DATA:?set DPIVON_DATA to the CIFAR-10 tarball or folder}"
mkdir -p "$OUT"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, torch.cuda.get_device_name())"

# Secure noise on the GPU: ChaCha20 bit-exactness and the draws on CUDA (the tests that
# skip without one, among them that the CUDA draws are the CPU's stream), then the secure /
# research step ratio and the noise alone in ns per coordinate ($OUT/secure-noise.json).
PYTHONPATH=. "$PYTHON" -m pytest -q -rs tests/test_chacha.py tests/test_secure_noise.py \
    -k "cuda or device or torch_keystream"
"$PYTHON" benchmarks/secure_noise.py --device cuda --cases tanh-cnn:256 tanh-cnn:1024 \
    wrn-16-4:64 wrn-16-4:1024 --steps "${STEPS:-10}" --json "$OUT/secure-noise.json"

# The CIFAR-10 cache is built once (about a minute), so that the epoch times below measure
# the loading a run does, not the one-off JPEG decoding.
"$PYTHON" -c "from dpivon.data.cifar10 import load_cifar10; load_cifar10()"

"$PYTHON" benchmarks/step_time.py \
    --device cuda \
    --models tanh-cnn wrn-16-4 \
    --batch-sizes 256 1024 \
    --engines bk hooks functorch ghost \
    --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" \
    --epoch-dataset cifar10 --data-path "$DPIVON_DATA" --epoch-batch-size 256 \
    --json "$OUT/gpu.json"

# Whole trials as users run them (the real `dpivon train`, default evaluation settings).
"$PYTHON" benchmarks/trial_time.py --device cuda --per-class 400 --epochs 2 \
    --repeats "${REPEATS:-2}" --data-path "$DPIVON_DATA" --json "$OUT/trial-4k.json"
"$PYTHON" benchmarks/trial_time.py --device cuda --per-class 0 --epochs 1 \
    --repeats "${REPEATS:-2}" --data-path "$DPIVON_DATA" --json "$OUT/trial-full.json"
