"""Secure noise (dpivon.privacy.noise): what a released model's noise is drawn from.

A ChaCha20 stream keyed with 256 bits from the OS draws the DP noise and the Poisson masks
on every device; the statistics are checked on 10^6 draws, runs are independent, nothing
logged or exported holds the key, and the 32-bit collision of the old torch-seeded secure
mode is gone. Research mode stays reproducible from its seed, and says so.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from scipy import stats
from typer.testing import CliRunner

import dpivon.privacy.noise as noise_module
from dpivon.cli import app
from dpivon.config import parse_config
from dpivon.privacy.noise import (
    DEFENCE_DRAWS,
    KEY_BYTES,
    NOISE_TAG,
    SecureRandomness,
    SeededRandomness,
    gaussian_noise,
)
from dpivon.runs import build_training, load_data, train_step

CPU = torch.device("cpu")
runner = CliRunner()
MILLION = 10**6
SMALL = {
    "dataset": "synthetic",
    "synthetic_size": 330,
    "val_size": 30,
    "model": "small-cnn",
    "epochs": 1,
    "batch_size": 30,
    "bma_samples": 0,
    "optimizer": "dp-sgd",
}


def test_secure_uniforms_and_gaussians_pass_ks_on_a_million_draws():
    randomness = SecureRandomness()
    uniforms = randomness.uniform(MILLION, CPU)
    assert uniforms.dtype == torch.float64 and uniforms.min() >= 0 and uniforms.max() < 1
    assert stats.kstest(uniforms.numpy(), "uniform").pvalue > 1e-3
    gaussians = randomness.normal(MILLION, CPU)
    assert gaussians.dtype == torch.float64
    assert stats.kstest(gaussians.numpy(), "norm").pvalue > 1e-3
    # The DP noise itself: four draws summed and halved (the floating-point defence) keep
    # N(0, std^2); float64 until the cast.
    noise = gaussian_noise(randomness, 0.7, MILLION, CPU, torch.float64)
    assert stats.kstest(noise.numpy() / 0.7, "norm").pvalue > 1e-3
    # The control: a KS test of this size sees a 1% error in the std.
    assert stats.kstest(noise.numpy() / 0.7 * 1.01, "norm").pvalue < 1e-3


def test_float32_noise_passes_ks_and_its_control_sees_a_1_percent_std_error():
    """The DP noise of float32 parameters is made in float32 (each draw's radius from 31
    bits): its statistics on 10^6 coordinates, the draws' too, and independence of
    neighbouring coordinates and of the Box-Muller pair's two halves."""
    randomness = SecureRandomness()
    gaussians = randomness.normal(MILLION, CPU, torch.float32)
    assert gaussians.dtype == torch.float32
    assert stats.kstest(gaussians.numpy(), "norm").pvalue > 1e-3
    cosines, sines = gaussians.double().numpy().reshape(2, -1)
    assert abs(float(np.corrcoef(cosines, sines)[0, 1])) < 0.005
    noise = gaussian_noise(randomness, 0.7, MILLION, CPU, torch.float32)
    assert noise.dtype == torch.float32
    scaled = noise.double().numpy() / 0.7
    assert stats.kstest(scaled, "norm").pvalue > 1e-3
    assert stats.kstest(scaled * 1.01, "norm").pvalue < 1e-3  # the control
    assert stats.kstest(scaled * 0.99, "norm").pvalue < 1e-3
    assert abs(float(np.corrcoef(scaled[:-1], scaled[1:])[0, 1])) < 0.005
    # Half-precision parameters get float32 draws cast to their dtype.
    assert gaussian_noise(randomness, 0.7, 10, CPU, torch.bfloat16).dtype == torch.bfloat16


def test_uniforms_are_the_top_53_bits_of_each_draw_s_chacha20_message():
    """Draw k is the message with nonce k (12 bytes, little-endian), block counter 0."""
    key = bytes(range(7, 7 + KEY_BYTES))
    randomness = SecureRandomness(key)
    for draw in range(3):
        uniforms = randomness.uniform(1000, CPU)
        iv = bytes(4) + draw.to_bytes(12, "little")  # cryptography's counter, then nonce
        stream = Cipher(algorithms.ChaCha20(key, iv), mode=None).encryptor().update(bytes(8000))
        top = np.frombuffer(stream, dtype="<u8") >> np.uint64(11)
        assert torch.equal(uniforms, torch.from_numpy(top.astype(np.float64) * 2.0**-53))


def draws_of(key: bytes, device: torch.device) -> list[torch.Tensor]:
    randomness = SecureRandomness(key)
    return [
        randomness.uniform(1001, device),
        randomness.normal(1001, device),
        randomness.normal(1000, device, torch.float32),
        gaussian_noise(randomness, 0.3, 999, device, torch.float32),
    ]


def test_the_torch_keystream_draws_what_openssl_draws(monkeypatch):
    """Off a CPU the keystream is `dpivon.privacy.chacha`'s: made so on the CPU too, every
    draw is bit-identical to OpenSSL's."""
    key = bytes(range(50, 50 + KEY_BYTES))
    expected = draws_of(key, CPU)
    monkeypatch.setattr(noise_module, "_OPENSSL_DEVICES", frozenset())
    for ours, theirs in zip(draws_of(key, CPU), expected, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_draws_are_the_cpu_s_stream():
    """Same key, same uniforms bit for bit on CUDA; the Gaussians agree to the devices'
    transcendental functions."""
    key = bytes(range(50, 50 + KEY_BYTES))
    cuda = draws_of(key, torch.device("cuda"))
    cpu = draws_of(key, CPU)
    assert all(draw.device.type == "cuda" for draw in cuda)
    assert torch.equal(cuda[0].cpu(), cpu[0])
    for ours, theirs in zip(cuda[1:], cpu[1:], strict=True):
        torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-5, atol=1e-5)


def host_copies(monkeypatch, at_least: int) -> list[str]:
    """Record every move of a tensor of ``at_least`` elements from the CPU to another
    device (``Tensor.to`` with a device, ``Tensor.copy_``, ``torch.from_numpy`` of noise)."""
    moves: list[str] = []
    to, copy_, from_numpy = torch.Tensor.to, torch.Tensor.copy_, torch.from_numpy

    def recording_to(self, *args, **kwargs):
        moved = to(self, *args, **kwargs)
        if self.device.type == "cpu" and moved.device != self.device and self.numel() >= at_least:
            moves.append(f"to {tuple(self.shape)} -> {moved.device}")
        return moved

    def recording_copy(self, src, *args, **kwargs):
        if src.device.type == "cpu" and self.device != src.device and src.numel() >= at_least:
            moves.append(f"copy_ {tuple(src.shape)} -> {self.device}")
        return copy_(self, src, *args, **kwargs)

    def recording_from_numpy(array):
        if array.size >= at_least:
            moves.append(f"from_numpy {array.shape}")
        return from_numpy(array)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
    monkeypatch.setattr(torch, "from_numpy", recording_from_numpy)
    return moves


def test_secure_noise_and_masks_are_made_on_their_device(monkeypatch):
    """On a device other than the CPU (here "meta", which runs every kernel without data)
    nothing of noise size comes from the host, and every working tensor is on the device:
    the keystream, the uniforms and the Gaussians are made there."""
    meta, count = torch.device("meta"), 10_000
    randomness = SecureRandomness()
    moves = host_copies(monkeypatch, at_least=count // 4)
    for _ in range(2):  # the second step reuses the first one's working tensors
        noise = gaussian_noise(randomness, 0.5, count, meta, torch.float32)
        mask = randomness.uniform(count, meta)
    assert moves == []
    assert noise.device == mask.device == meta and noise.shape == (count,)
    assert {buffer.device for buffer in randomness._buffers.values()} == {meta}
    # words of two sizes, radii, angles, the draws, their sums
    assert len(randomness._buffers) == 6


def test_one_secure_training_step_moves_no_noise_from_numpy_or_between_devices(
    one_thread, monkeypatch
):
    """One step of a secure CPU run: no tensor of the model's size goes through numpy or
    ``Tensor.to(device)``, which is how the noise used to reach the device (float64
    Box-Muller on the host, then ``.to(device, dtype)``)."""
    config = parse_config({**SMALL, "seed": 3})
    setup = build_training(config, load_data(config), CPU)
    n_params = sum(p.numel() for p in setup.model.parameters())
    x, y = next(iter(setup.loader))
    moves = host_copies(monkeypatch, at_least=n_params)
    train_step(setup, x, y, mc_samples=1)
    assert moves == []


def test_the_noise_sums_four_draws_of_the_stream():
    key = bytes(range(KEY_BYTES))
    noise = gaussian_noise(SecureRandomness(key), 2.0, 5, CPU, torch.float64)
    draws = SecureRandomness(key).normal(DEFENCE_DRAWS * 5, CPU).view(DEFENCE_DRAWS, 5)
    torch.testing.assert_close(noise, draws.sum(0) * 2.0 / 2, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_noise_made_by_chunks_is_the_whole_draw_s_sum_bit_for_bit(monkeypatch, dtype):
    """On a CPU the defended noise is made a chunk of coordinates at a time, each read at
    its place in the keystream: bit for bit the sums of the four draws that one message of
    4 n Gaussians gives (chunks of 48 coordinates here: block-unaligned starts, a tail)."""
    monkeypatch.setattr(noise_module, "_CPU_CHUNK", 48)
    key = bytes(range(7, 7 + KEY_BYTES))
    for count in (1, 5, 48, 49, 1001):
        chunked = SecureRandomness(key, draws=3).defended_normal(count, 2.0, CPU, dtype)
        whole = torch.empty(DEFENCE_DRAWS * count, dtype=dtype)
        SecureRandomness(key, draws=3).fill_normal(whole)
        assert torch.equal(chunked, whole.view(DEFENCE_DRAWS, count).sum(0)), count


def test_a_secure_step_draws_its_noise_into_the_same_buffers_every_time(monkeypatch):
    """The noise of every step lands in the tensors the first step made (one per size), and
    the gradients are the clipped sums the noise was added to: no per-step allocation."""
    randomness = SecureRandomness()
    first = gaussian_noise(randomness, 1.0, 70_000, CPU, torch.float32).data_ptr()
    buffers = {name: tensor.data_ptr() for name, tensor in randomness._buffers.items()}
    second = gaussian_noise(randomness, 1.0, 70_000, CPU, torch.float32).data_ptr()
    assert first == second
    assert {n: t.data_ptr() for n, t in randomness._buffers.items()} == buffers

    config = parse_config({**SMALL, "seed": 5})
    setup = build_training(config, load_data(config), CPU)
    x, y = next(iter(setup.loader))
    sums: dict = {}
    real_add_noise = type(setup.optimizer).add_noise

    def add_noise(self):
        sums.update({id(p): p.summed_grad.data_ptr() for p in self.params})
        real_add_noise(self)

    monkeypatch.setattr(type(setup.optimizer), "add_noise", add_noise)
    train_step(setup, x, y, mc_samples=1)
    assert sums and all(p.grad.data_ptr() == sums[id(p)] for p in setup.model.parameters())


def test_runs_are_independent_and_keys_come_from_the_os(monkeypatch):
    first, second = SecureRandomness().normal(MILLION, CPU), SecureRandomness().normal(MILLION, CPU)
    assert abs(float(np.corrcoef(first.numpy(), second.numpy())[0, 1])) < 0.005
    asked = []
    import dpivon.privacy.noise as noise

    real = noise.os.urandom
    monkeypatch.setattr(noise.os, "urandom", lambda n: asked.append(n) or real(n))
    SecureRandomness()
    assert asked == [KEY_BYTES]  # 256 bits of OS entropy per run


def test_the_old_32_bit_seed_collision_is_gone():
    """torch's CPU generator keeps 32 bits of a seed (what secure mode used to rely on):
    seeds s and s & 0xffffffff drew the same noise. Keys that differ anywhere do not."""
    s = 7_301_999_123_456_789
    old = [torch.randn(8, generator=torch.Generator().manual_seed(v)) for v in (s, s & 0xFFFFFFFF)]
    assert torch.equal(*old)  # the collision this test guards against
    key = s.to_bytes(KEY_BYTES, "big")
    low = (s & 0xFFFFFFFF).to_bytes(KEY_BYTES, "big")
    flipped = bytes([key[0] ^ 1]) + key[1:]  # one bit of the highest byte
    draws = [SecureRandomness(k).normal(8, CPU) for k in (key, low, flipped)]
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_the_stream_resumes_from_its_state_instead_of_replaying():
    randomness = SecureRandomness()
    first = randomness.uniform(100, CPU)
    buffer = io.BytesIO()
    torch.save(randomness.state_dict(), buffer)  # as a resume checkpoint stores it
    expected = randomness.uniform(100, CPU)
    buffer.seek(0)
    resumed = SecureRandomness()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(resumed.uniform(100, CPU), expected)
    assert not torch.equal(first, expected)


def noise_of_an_empty_batch(setup) -> torch.Tensor:
    """The privatised gradient of an empty Poisson batch: the DP noise / b alone."""
    x, y = next(iter(setup.loader))
    train_step(setup, x[:0], y[:0], mc_samples=1)
    return torch.cat([p.grad.flatten() for p in setup.model.parameters()])


def test_a_private_run_is_secure_by_default_and_research_mode_follows_the_seed(one_thread):
    config = parse_config({**SMALL, "seed": 5})
    data = load_data(config)
    assert config.privacy.research_mode is False
    setup = build_training(config, data, CPU)
    assert isinstance(setup.randomness, SecureRandomness)
    assert setup.private.loader.randomness is setup.randomness  # the Poisson mask too
    assert setup.optimizer.secure_mode  # the floating-point defence is on
    secure = noise_of_an_empty_batch(setup)
    assert secure.std().item() == pytest.approx(setup.private.plan.grad_noise_std, rel=0.05)
    research = config.replace(research_mode=True)
    first, second = (build_training(research, data, CPU) for _ in range(2))
    assert isinstance(first.randomness, SeededRandomness)
    # The control: research noise is the seed's, the same in every run with that seed.
    seeded = noise_of_an_empty_batch(first)
    assert torch.equal(seeded, noise_of_an_empty_batch(second))
    assert abs(float(np.corrcoef(secure.numpy(), seeded.numpy())[0, 1])) < 0.05


def test_no_key_in_anything_train_logs_or_prints(tmp_path, monkeypatch):
    """`dpivon train` (secure by default) logs its model: the key from the OS appears in no
    param, tag, metric, artifact, model file or output. (What research mode's models say:
    tests/test_sweep.py.)"""
    key = bytes(range(101, 101 + KEY_BYTES))  # what the patched OS entropy source returns
    import dpivon.privacy.noise as noise

    monkeypatch.setattr(noise, "os_key", lambda: key)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    flags = ["train", "--dataset", "synthetic", "--set", "synthetic_size=330", "--set",
             "val_size=30", "--model", "small-cnn", "--optimizer", "dp-sgd", "--epochs", "1",
             "--batch-size", "30", "--bma-samples", "0", "--tracking-uri", uri]  # fmt: skip
    secure = runner.invoke(app, [*flags, "--json", str(tmp_path / "out.json")])
    assert secure.exit_code == 0, secure.output

    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("dpivon").experiment_id])
    assert run.data.params["research_mode"] == "False"
    assert run.data.tags[NOISE_TAG].startswith("secure")
    mlflow.set_tracking_uri(uri)  # MLflow finds a logged model through it, whatever is passed
    files = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=f"runs:/{run.info.run_id}/model", dst_path=str(tmp_path / "model"),
            tracking_uri=uri,
        )
    ).rglob("*")  # fmt: skip
    blobs = [p.read_bytes() for p in files if p.is_file()]
    assert any(b"checkpoint" in blob or len(blob) > 10_000 for blob in blobs)  # the model
    texts = [
        json.dumps([run.data.params, run.data.tags, run.data.metrics]),
        (tmp_path / "out.json").read_text(),
        secure.output,
    ]
    for form in (key.hex(), str(list(key)), str(int.from_bytes(key, "big"))):
        assert not any(form in text for text in texts)
        assert not any(form.encode() in blob for blob in blobs)
    assert not any(key in blob for blob in blobs)


def test_an_older_config_s_secure_mode_leaves_the_noise_secure():
    """Files from before the default changed hold secure_mode (false in most of them):
    noise stays secure; only an explicit research_mode makes it reproducible."""
    for older in ({"secure_mode": False}, {"privacy": {"secure_mode": True}}):
        assert parse_config({**SMALL, **older}).privacy.research_mode is False
    assert parse_config({**SMALL, "research_mode": True}).privacy.research_mode is True
