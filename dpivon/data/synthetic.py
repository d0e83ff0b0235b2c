"""Small, learnable CIFAR-shaped data for smoke tests and runs without the real data set."""

from __future__ import annotations

import numpy as np

from dpivon.data.arrays import CIFAR10_CLASSES, IMAGE_SHAPE, ImageArrays
from dpivon.errors import DpivonError

# Each class is a coarse 4x4 colour pattern (blown up to 32x32) plus per-pixel noise: the
# pattern contrast is several times the noise, so a small CNN learns it within an epoch,
# while the noise keeps the task from being trivially solved by a single pixel.
_GRID = 4
_NOISE_STD = 40.0
# Images made at once: the float64 noise and sum of a chunk are its transient memory
# (about 50 KB an image), so a large set peaks at its uint8 images plus a chunk's worth.
_CHUNK_IMAGES = 4096


def synthetic_cifar10(
    n_train: int = 1000, n_test: int = 200, seed: int = 0
) -> tuple[ImageArrays, ImageArrays]:
    """Deterministic (train, test) with class templates plus noise; class counts differ by <= 1."""
    n_classes = len(CIFAR10_CLASSES)
    for name, n in (("n_train", n_train), ("n_test", n_test)):
        if n < n_classes:
            raise DpivonError(
                f"{name} must be at least {n_classes} (one image per class), got {n}; "
                "pass a larger size"
            )
    rng = np.random.default_rng(seed)
    block = IMAGE_SHAPE[0] // _GRID
    coarse = rng.uniform(30.0, 225.0, size=(n_classes, _GRID, _GRID, 3))
    templates = coarse.repeat(block, axis=1).repeat(block, axis=2)
    return _sample(templates, n_train, rng), _sample(templates, n_test, rng)


def _sample(templates: np.ndarray, n: int, rng: np.random.Generator) -> ImageArrays:
    labels = rng.permutation(np.arange(n, dtype=np.int64) % len(templates))
    images = np.empty((n, *IMAGE_SHAPE), dtype=np.uint8)
    for start in range(0, n, _CHUNK_IMAGES):  # the noise stream is the same as in one draw
        chunk = labels[start : start + _CHUNK_IMAGES]
        noisy = templates[chunk] + rng.normal(0.0, _NOISE_STD, size=(len(chunk), *IMAGE_SHAPE))
        images[start : start + len(chunk)] = np.clip(np.rint(noisy), 0, 255)
    return ImageArrays(images, labels, CIFAR10_CLASSES)
