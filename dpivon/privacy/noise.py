"""Where a private run's randomness comes from: the Poisson masks, the DP noise on the
clipped gradient sum and the noise of DP validation scores.

- `SecureRandomness` (the default): a ChaCha20 keystream under a 256-bit key from
  ``os.urandom``, made on the device the draws are for: on a CPU by OpenSSL (through the
  ``cryptography`` package), elsewhere by `dpivon.privacy.chacha`'s torch operations, which
  are bit-identical to it, so every device draws the same stream and no noise crosses from
  host to device. Its words become uniforms and, by Box-Muller, Gaussians on that device in
  the precision asked for. The key and the position in the stream are the only state. The key
  lives only in the process's memory: what is stored (checkpoints, models, MLflow) holds at
  most the position (`without_key`), and a resumed run continues under a fresh key.
- `SeededRandomness` (``research_mode: true``): a torch generator seeded from the run's
  seed. Anyone who knows the seed regenerates the noise and the batches, so nothing such a
  run releases has a DP guarantee (`RESEARCH_MODE_WARNING`).

`gaussian_noise` keeps Opacus's defence against floating-point attacks on the noise
(arXiv 2107.10138 section 5.1, Opacus ``secure_mode``): in secure mode each coordinate is
the sum of four N(0, std^2) draws, halved. `NoiseFromRandomness` makes an Opacus DP
optimizer draw its noise there.
"""

from __future__ import annotations

import math
import os
from typing import Any, Protocol

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from torch import Tensor

from dpivon.privacy.chacha import KEY_BYTES, NONCE_BYTES, key_words_on, keystream_words

RESEARCH_MODE_WARNING = (
    "research mode: the DP noise and Poisson sampling are reproducible from public seeds, so "
    "no DP guarantee holds for the released models, whatever epsilon is quoted"
)
SECURE_NOISE_NOTE = (
    "secure: DP noise and Poisson sampling from a ChaCha20 stream keyed with 256 bits from the "
    "OS; the key is in no released artefact"
)
NO_NOISE_NOTE = "none: a non-private optimizer"
NOISE_TAG = "dpivon.noise"  # the run tag and model metadata key that says which noise ran
# Opacus's secure_mode: 2n Gaussian draws per coordinate with n = 2 (sum halved: same std).
DEFENCE_DRAWS = 4
# Stream label mixed into the research seed so the privacy generator never shares a stream
# with model initialisation or posterior sampling (which use the global RNG).
_PRIVACY_STREAM = 0x5EED_D1CE
# Where OpenSSL makes the keystream: on a CPU its SIMD ChaCha20 is about 30 times faster
# than `dpivon.privacy.chacha`'s torch operations (measured: 2.2 M words in 20-30 ms
# against 0.8 s), and the stream is the same; on any other device the torch operations
# make it there.
_OPENSSL_DEVICES = frozenset({"cpu"})
# Per float dtype: the integer keystream words of its width and its significand's bits.
# Gaussians for other parameter dtypes (half precision) are drawn in float32 and cast.
_WORDS = {torch.float32: (torch.int32, 24), torch.float64: (torch.int64, 53)}
_BLOCK_WORDS = 16  # 32-bit words in a ChaCha20 block (64 bytes)
# Coordinates of defended noise made at once on a CPU: the chunk's keystream words, radii
# and angles (about 1 MB) stay in cache, where the whole draw's (16 bytes a Gaussian, four
# Gaussians a coordinate: 176 MB for WRN-16-4) would pass through memory several times.
_CPU_CHUNK = 2**15


class Randomness(Protocol):
    """A source of float64 uniforms and Gaussians that can be saved and resumed."""

    secure: bool

    def uniform(self, count: int, device: torch.device) -> Tensor: ...

    def normal(self, count: int, device: torch.device) -> Tensor: ...

    def state_dict(self) -> dict[str, Tensor]: ...

    def load_state_dict(self, state: dict[str, Tensor]) -> None: ...


def _word_bits(words: Tensor) -> int:
    return 8 * words.element_size()


def unit_uniforms(words: Tensor, out: Tensor, scale: float = 1.0) -> Tensor:
    """Uniforms in [0, ``scale``) in ``out`` from the top p bits of integer ``words`` of
    its width (p = its significand, 24 or 53): every multiple of 2^-p (times ``scale``),
    each with probability 2^-p, exact in ``out``'s dtype when ``scale`` is 1. ``words`` is
    overwritten."""
    width, bits = _word_bits(words), _WORDS[out.dtype][1]
    # The arithmetic shift copies the sign bit: the mask makes it a logical one.
    words.bitwise_right_shift_(width - bits).bitwise_and_(2**bits - 1)
    return out.copy_(words).mul_(scale * 2.0**-bits)


def positive_uniforms(words: Tensor, out: Tensor) -> Tensor:
    """Uniforms in (0, 1] in ``out``: (m + 1) 2^-(w-1) for the top w - 1 bits m of the
    w-bit ``words``, so a logarithm never meets 0 and its tail keeps all of them: values
    up to 2^-7 in float32 (2^-10 in float64), the tail, are exact; larger ones round to
    ``out``'s significand, a relative 2^-24 (2^-53) that moves radii below 3.1 (3.7)
    slightly. ``words`` is overwritten."""
    width = _word_bits(words)
    words.bitwise_right_shift_(1).bitwise_and_(2 ** (width - 1) - 1)
    return out.copy_(words).add_(1.0).mul_(2.0 ** -(width - 1))


def os_key() -> bytes:
    """A fresh 256-bit key from the operating system's entropy source."""
    return os.urandom(KEY_BYTES)


class SecureRandomness:
    """A ChaCha20 keystream under a key from the OS. Each draw is one message of its own
    (nonce = the number of draws before it, block counter from 0), so (key, draws) is the
    whole state and a resumed run continues the stream instead of replaying it. Working
    tensors (keystream words, radii, angles, the defence's draws) are kept for the next
    draw of the same size: a training run allocates them once, not at every step."""

    secure = True

    def __init__(self, key: bytes | None = None, draws: int = 0) -> None:
        self._set_key(os_key() if key is None else bytes(key))
        self._draws = draws
        self._buffers: dict[tuple[str, int, torch.dtype, torch.device], Tensor] = {}

    def _set_key(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a ChaCha20 key is {KEY_BYTES} bytes, got {len(key)}")
        self._key = key
        self._device_keys: dict[torch.device, Tensor] = {}  # the key's words per device

    def _buffer(
        self, name: str, count: int, dtype: torch.dtype, device: torch.device, zeros: bool = False
    ) -> Tensor:
        """The working tensor ``name`` of this size, made at its first use. One per size: a
        step draws masks and noise of different sizes, each of the same size every step."""
        key = (name, count, dtype, device)
        if key not in self._buffers:
            make = torch.zeros if zeros else torch.empty
            self._buffers[key] = make(count, dtype=dtype, device=device)
        return self._buffers[key]

    def _next_nonce(self) -> bytes:
        """The nonce of the next draw's message: the number of draws before it."""
        nonce = self._draws.to_bytes(NONCE_BYTES, "little")
        self._draws += 1
        return nonce

    def _openssl_words(self, nonce: bytes, start: int, out: Tensor) -> Tensor:
        """32-bit words ``start`` to ``start + len(out)`` of message ``nonce``'s keystream
        in the int32 CPU tensor ``out``, by OpenSSL from the block that holds word ``start``."""
        block, skip = divmod(start, _BLOCK_WORDS)
        iv = block.to_bytes(4, "little") + nonce  # cryptography's: the counter, then RFC's
        encryptor = Cipher(algorithms.ChaCha20(self._key, iv), mode=None).encryptor()
        encryptor.update(bytes(4 * skip))
        zeros = self._buffer("zeros", out.numel(), torch.int32, out.device, zeros=True)
        encryptor.update_into(zeros.numpy().view(np.uint8), out.numpy().view(np.uint8))
        return out

    def _keystream(self, count: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The next message's first ``count`` keystream words of integer ``dtype`` (int32
        or int64, the byte stream's little-endian words) in a working tensor on ``device``."""
        words = self._buffer("words", count * dtype.itemsize // 4, torch.int32, device)
        nonce = self._next_nonce()
        if device.type in _OPENSSL_DEVICES:
            self._openssl_words(nonce, 0, words)
        else:
            if device not in self._device_keys:
                self._device_keys[device] = key_words_on(self._key, device)
            keystream_words(self._device_keys[device], nonce, words.numel(), out=words)
        return words.view(dtype)

    def uniform(self, count: int, device: torch.device) -> Tensor:
        """``count`` float64 uniforms in [0, 1) (53 bits of a 64-bit word each)."""
        out = torch.empty(count, dtype=torch.float64, device=device)
        return unit_uniforms(self._keystream(count, device, torch.int64), out)

    def fill_normal(self, out: Tensor) -> Tensor:
        """Fill 1-d ``out`` (even length, float32 or float64) with standard Gaussians by
        Box-Muller: radius sqrt(-2 log v) for v in (0, 1], angle 2 pi u for u in [0, 1),
        one keystream word of ``out``'s width per Gaussian, made on ``out``'s device."""
        pairs = out.numel() // 2
        word_dtype = _WORDS[out.dtype][0]
        words = self._keystream(out.numel(), out.device, word_dtype)
        radius = self._buffer("radius", pairs, out.dtype, out.device)
        angle = self._buffer("angle", pairs, out.dtype, out.device)
        positive_uniforms(words[:pairs], radius).log_().mul_(-2.0).sqrt_()
        unit_uniforms(words[pairs:], angle, 2.0 * math.pi)
        # Cosines in the first half, sines in the second: both coordinates of each pair.
        torch.cos(angle, out=out[:pairs]).mul_(radius)
        torch.sin(angle, out=out[pairs:]).mul_(radius)
        return out

    def normal(
        self, count: int, device: torch.device, dtype: torch.dtype = torch.float64
    ) -> Tensor:
        """``count`` standard Gaussians of ``dtype`` (float32 or float64) on ``device``."""
        out = torch.empty(count + count % 2, dtype=dtype, device=device)
        return self.fill_normal(out)[:count]

    def defended_normal(
        self, count: int, std: float, device: torch.device, dtype: torch.dtype
    ) -> Tensor:
        """``count`` draws of N(0, std^2) under Opacus's floating-point defence: each the
        sum of four draws, halved, made in ``dtype`` on ``device``.

        The precision is the parameters' (Opacus's own ``secure_mode`` sums torch's
        float32 draws of the parameters' dtype the same way): the noise is added to
        gradients of that dtype, so float64 draws would be rounded to it anyway, and the
        four-draw sum is what hides a single draw's floating-point support. Each draw's
        radius takes 31 bits (float32; 63 in float64), so its tail is cut at probability
        2^-31, 6.6 std (a 24-bit float32 uniform would cut it at 2^-24, 5.8 std).

        The result is a working tensor, overwritten by the next draw of its size: add it
        where it goes before drawing again.
        """
        work = dtype if dtype in _WORDS else torch.float32
        noise = self._buffer("noise", count, work, device)
        if device.type in _OPENSSL_DEVICES:
            self._defended_by_chunks(noise)
        else:
            draws = self._buffer("defence", DEFENCE_DRAWS * count, work, device)
            self.fill_normal(draws)
            torch.sum(draws.view(DEFENCE_DRAWS, count), 0, out=noise)
        return noise.mul_(std / 2.0).to(dtype)

    def _defended_by_chunks(self, noise: Tensor) -> None:
        """The sums of four draws that `fill_normal` makes from one message of
        4 x ``len(noise)`` draws (those ``defended_normal`` sums elsewhere), made on the CPU a
        chunk of coordinates at a time: coordinate j sums draws j, n + j, 2n + j and 3n + j,
        whose radii come from words j and n + j of the message and angles from words 2n + j
        and 3n + j (Box-Muller's layout in `fill_normal`), each read at its place in the
        keystream by OpenSSL (a ChaCha20 block is addressable by its counter)."""
        count, dtype = noise.numel(), noise.dtype
        per_word = _WORDS[dtype][0].itemsize // 4  # 32-bit words per keystream word
        nonce = self._next_nonce()
        for start in range(0, count, _CPU_CHUNK):
            n = min(_CPU_CHUNK, count - start)
            words = self._buffer("chunk words", 4 * n * per_word, torch.int32, noise.device)
            rows = words.view(4, n * per_word)
            for row, first in zip(rows, (0, count, 2 * count, 3 * count), strict=True):
                self._openssl_words(nonce, (first + start) * per_word, row)
            words = rows.view(_WORDS[dtype][0])  # (4, n): radii 0-1, angles 2-3
            radius = self._buffer("chunk radius", 2 * n, dtype, noise.device).view(2, n)
            angle = self._buffer("chunk angle", 2 * n, dtype, noise.device).view(2, n)
            cosine = self._buffer("chunk cosine", 2 * n, dtype, noise.device).view(2, n)
            positive_uniforms(words[:2], radius).log_().mul_(-2.0).sqrt_()
            unit_uniforms(words[2:], angle, 2.0 * math.pi)
            torch.cos(angle, out=cosine).mul_(radius)
            sine = angle.sin_().mul_(radius)
            # the four draws summed in `torch.sum`'s order over them: cos, cos, sin, sin
            out = noise[start : start + n]
            torch.add(cosine[0], cosine[1], out=out).add_(sine[0]).add_(sine[1])

    def state_dict(self) -> dict[str, Tensor]:
        return {
            "key": torch.frombuffer(bytearray(self._key), dtype=torch.uint8),
            "draws": torch.tensor(self._draws, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Continue the stream of ``state``; a state without its key (`without_key`: one
        that was stored with the run's releases) continues under a fresh key from the OS."""
        self._set_key(bytes(state["key"].tolist()) if "key" in state else os_key())
        self._draws = int(state["draws"])


def without_key(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A randomness state that may be stored with what a run releases: a secure stream's
    key dropped, so that what was released does not determine the noise and batches of the
    steps after a resume (the resumed stream is keyed afresh); a seeded generator's state
    is kept, since the seed already reproduces it."""
    return {name: value for name, value in state.items() if name != "key"}


class SeededRandomness:
    """A torch generator on the training device, seeded from the run's seed: reproducible
    by anyone who knows the seed (research mode)."""

    secure = False

    def __init__(self, seed: int, device: torch.device) -> None:
        state = np.random.SeedSequence([seed, _PRIVACY_STREAM]).generate_state(1, np.uint64)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(int(state[0]) & (2**63 - 1))

    def uniform(self, count: int, device: torch.device) -> Tensor:
        where = self.generator.device
        return torch.rand(count, generator=self.generator, device=where, dtype=torch.float64).to(
            device
        )

    def normal(self, count: int, device: torch.device) -> Tensor:
        where = self.generator.device
        return torch.randn(count, generator=self.generator, device=where, dtype=torch.float64).to(
            device
        )

    def state_dict(self) -> dict[str, Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.generator.set_state(state["generator"])


def noise_statement(research: bool) -> str:
    """What a run's noise means for its releases: `SECURE_NOISE_NOTE` or the warning."""
    return RESEARCH_MODE_WARNING if research else SECURE_NOISE_NOTE


def noise_tags(research: bool, private: bool = True) -> dict[str, str]:
    """The tag every run (and every logged model's metadata) carries: which noise ran."""
    return {NOISE_TAG: noise_statement(research) if private else NO_NOISE_NOTE}


def mechanism_randomness(seed: int, device: torch.device, *, research: bool) -> Randomness:
    """The randomness of a run's sampling and noise: secure, or in research mode the seed's."""
    return SeededRandomness(seed, device) if research else SecureRandomness()


def gaussian_noise(
    randomness: Randomness,
    std: float,
    count: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``count`` draws of N(0, std^2) on ``device``. Secure: Opacus's floating-point
    defence (`SecureRandomness.defended_normal`) in ``dtype``; research: one draw."""
    if std == 0:
        return torch.zeros(count, device=device, dtype=dtype)
    if isinstance(randomness, SecureRandomness):
        return randomness.defended_normal(count, std, device, dtype)
    return (randomness.normal(count, device) * std).to(dtype)


class NoiseFromRandomness:
    """Mixin for Opacus's DP optimizers: ``add_noise`` draws N(0, (sigma C)^2) for all
    parameters at once from ``randomness`` (Opacus's own draws use a torch generator)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, randomness: Randomness, **kwargs: Any):
        # Opacus's secure_mode flag only says which noise is drawn: the draw is ours.
        super().__init__(optimizer, secure_mode=randomness.secure, generator=None, **kwargs)
        self.randomness = randomness

    def add_noise(self) -> None:
        params = self.params
        sums = [p.summed_grad for p in params]
        sizes = [s.numel() for s in sums]
        noise = gaussian_noise(
            self.randomness,
            self.noise_multiplier * self.max_grad_norm,
            sum(sizes),
            sums[0].device,
            sums[0].dtype,
        )
        # in place: the clipped sum is read nowhere after this (Opacus drops it at zero_grad),
        # so a step allocates no gradient-sized tensor for its noise
        for p, summed, chunk in zip(params, sums, noise.split(sizes), strict=True):
            p.grad = summed.add_(chunk.view_as(summed)).view_as(p)
