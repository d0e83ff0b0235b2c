"""Where a private run's randomness comes from: the Poisson masks, the DP noise on the
clipped gradient sum and the noise of DP validation scores.

- `SecureRandomness` (the default): a ChaCha20 keystream (OpenSSL, through the
  ``cryptography`` package) under a 256-bit key from ``os.urandom``. Its 64-bit words become
  float64 uniforms (53 bits) and, by Box-Muller, float64 Gaussians, made on the CPU and moved
  to the training device, so CPU and GPU runs draw from the same cryptographic stream. The
  key and the position in the stream are the only state: they live in resume checkpoints
  (as sensitive as the training data) and in nothing that is logged or exported.
- `SeededRandomness` (``research_mode: true``): a torch generator seeded from the run's
  seed. Anyone who knows the seed regenerates the noise and the batches, so nothing such a
  run releases has a DP guarantee (`RESEARCH_MODE_WARNING`).

`gaussian_noise` keeps Opacus's defence against floating-point attacks on the noise
(arXiv 2107.10138 section 5.1, Opacus ``secure_mode``): in secure mode each coordinate is
the sum of four N(0, std^2) draws, halved. `NoiseFromRandomness` makes an Opacus DP
optimizer draw its noise there.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from torch import Tensor

RESEARCH_MODE_WARNING = (
    "research mode: the DP noise and Poisson sampling are reproducible from public seeds, so "
    "no DP guarantee holds for the released models, whatever epsilon is quoted"
)
SECURE_NOISE_NOTE = (
    "secure: DP noise and Poisson sampling from a ChaCha20 stream keyed with 256 bits from the "
    "OS; the key is in no released artefact"
)
NOISE_TAG = "dpivon.noise"  # the run tag and model metadata key that says which noise ran
KEY_BYTES = 32  # ChaCha20's 256-bit key
# Opacus's secure_mode: 2n Gaussian draws per coordinate with n = 2 (sum halved: same std).
DEFENCE_DRAWS = 4
# Stream label mixed into the research seed so the privacy generator never shares a stream
# with model initialisation or posterior sampling (which use the global RNG).
_PRIVACY_STREAM = 0x5EED_D1CE
_UNIT = 2.0**-53


class Randomness(Protocol):
    """A source of float64 uniforms and Gaussians that can be saved and resumed."""

    secure: bool

    def uniform(self, count: int, device: torch.device) -> Tensor: ...

    def normal(self, count: int, device: torch.device) -> Tensor: ...

    def state_dict(self) -> dict[str, Tensor]: ...

    def load_state_dict(self, state: dict[str, Tensor]) -> None: ...


def uniforms_from_words(words: np.ndarray) -> np.ndarray:
    """Uniforms in [0, 1) from the top 53 bits of 64-bit words: every float64 multiple of
    2^-53, each with probability 2^-53."""
    return (words >> np.uint64(11)).astype(np.float64) * _UNIT


def box_muller(uniforms: np.ndarray) -> Tensor:
    """Independent standard Gaussians from an even number of uniforms in [0, 1): radius
    sqrt(-2 log(1 - u1)) at angle 2 pi u2, both coordinates kept. 1 - u1 is exact for a
    multiple of 2^-53 and in (0, 1]; numpy's log and torch's sin and cos are the fastest
    of the two libraries here (measured)."""
    first, second = np.split(uniforms, 2)
    radius = torch.from_numpy(np.sqrt(-2.0 * np.log(1.0 - first)))
    angle = torch.from_numpy(second).mul_(2.0 * np.pi)
    gaussians = torch.empty(len(uniforms), dtype=torch.float64)
    cosines, sines = gaussians.split(len(first))
    torch.cos(angle, out=cosines).mul_(radius)
    torch.sin(angle, out=sines).mul_(radius)
    return gaussians


def os_key() -> bytes:
    """A fresh 256-bit key from the operating system's entropy source."""
    return os.urandom(KEY_BYTES)


class SecureRandomness:
    """A ChaCha20 keystream under a key from the OS. Each draw is one message of its own
    (nonce = the number of draws before it, block counter from 0), so (key, draws) is the
    whole state and a resumed run continues the stream instead of replaying it."""

    secure = True

    def __init__(self, key: bytes | None = None, draws: int = 0) -> None:
        self._key = os_key() if key is None else bytes(key)
        if len(self._key) != KEY_BYTES:
            raise ValueError(f"a ChaCha20 key is {KEY_BYTES} bytes, got {len(self._key)}")
        self._draws = draws

    def words(self, count: int) -> np.ndarray:
        """The next ``count`` 64-bit words of the keystream."""
        # cryptography's 16-byte ChaCha20 nonce: 4-byte block counter, then 12 bytes.
        nonce = (0).to_bytes(4, "little") + self._draws.to_bytes(12, "little")
        encryptor = Cipher(algorithms.ChaCha20(self._key, nonce), mode=None).encryptor()
        self._draws += 1
        return np.frombuffer(encryptor.update(bytes(8 * count)), dtype=np.uint64)

    def uniform(self, count: int, device: torch.device) -> Tensor:
        return torch.from_numpy(uniforms_from_words(self.words(count))).to(device)

    def normal(self, count: int, device: torch.device) -> Tensor:
        pairs = (count + 1) // 2
        return box_muller(uniforms_from_words(self.words(2 * pairs)))[:count].to(device)

    def state_dict(self) -> dict[str, Tensor]:
        return {
            "key": torch.frombuffer(bytearray(self._key), dtype=torch.uint8),
            "draws": torch.tensor(self._draws, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Continue the stream of ``state``; a state without its key (`without_key`: one
        that was stored with the run's releases) continues under a fresh key from the OS."""
        self._key = bytes(state["key"].tolist()) if "key" in state else os_key()
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
    """``count`` draws of N(0, std^2). Secure: Opacus's floating-point defence, the sum of
    four draws halved, in float64 before the cast to ``dtype``; research: one draw."""
    if std == 0:
        return torch.zeros(count, device=device, dtype=dtype)
    if not randomness.secure:
        return (randomness.normal(count, device) * std).to(dtype)
    draws = randomness.normal(DEFENCE_DRAWS * count, torch.device("cpu"))
    summed = draws.view(DEFENCE_DRAWS, count).sum(0) * (std / 2.0)
    return summed.to(device=device, dtype=dtype)


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
        for p, summed, chunk in zip(params, sums, noise.split(sizes), strict=True):
            p.grad = (summed + chunk.view_as(summed)).view_as(p)
