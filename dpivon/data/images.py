"""Images as people have them (PNG/JPEG files, a .npy batch, uint8 or float arrays in
either layout) turned into what the models take: CIFAR-normalised float32 (N, 3, 32, 32)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from dpivon.data.arrays import IMAGE_SHAPE
from dpivon.data.splits import cifar_normalise_
from dpivon.errors import DpivonError
from dpivon.paths import check_regular_file

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
CHANNELS_FIRST = (IMAGE_SHAPE[2], IMAGE_SHAPE[0], IMAGE_SHAPE[1])  # (3, 32, 32)


def model_input(images: np.ndarray, *, cifar_normalised: bool = False) -> Tensor:
    """CIFAR-normalised float32 (N, 3, 32, 32) from a batch of images.

    Accepted: (N, 32, 32, 3) or (N, 3, 32, 32); integers are 0-255 pixels (uint8 images,
    or integer JSON), floats are pixels in [0, 1], or already CIFAR-normalised when
    ``cifar_normalised`` (the training tensors' form)."""
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[1:] not in (IMAGE_SHAPE, CHANNELS_FIRST):
        raise DpivonError(
            f"images must be a batch (N, 32, 32, 3) or (N, 3, 32, 32), got shape {images.shape}"
        )
    integer = np.issubdtype(images.dtype, np.integer) or images.dtype == np.bool_
    if not integer and not np.issubdtype(images.dtype, np.floating):
        raise DpivonError(f"images must be integers 0-255 or floats, got dtype {images.dtype}")
    if images.size and not np.isfinite(images).all():
        raise DpivonError("images hold NaN or infinite values")
    if cifar_normalised:
        if integer:
            raise DpivonError("cifar_normalised images are floats; these are integers")
    elif images.size:
        low, high = (0, 255) if integer else (0.0, 1.0)
        if images.min() < low or images.max() > high:
            kind = "integer images are 0-255 pixels" if integer else "float images are in [0, 1]"
            raise DpivonError(
                f"{kind}, got values in [{images.min()}, {images.max()}]; pass uint8 pixels, "
                "floats in [0, 1], or CIFAR-normalised floats with cifar_normalised=true"
            )
    tensor = torch.as_tensor(images).to(torch.float32)
    if images.shape[1:] == IMAGE_SHAPE:
        tensor = tensor.permute(0, 3, 1, 2)
    tensor = tensor.contiguous()
    if cifar_normalised:
        return tensor
    if integer:
        tensor.div_(255.0)
    return cifar_normalise_(tensor)


def read_images(paths: Iterable[str | Path]) -> tuple[list[str], np.ndarray]:
    """The images of PNG/JPEG files, folders of them (with subfolders, sorted) and .npy
    batches, as names and one (N, 32, 32, 3) array: uint8, or a float .npy batch's floats."""
    names: list[str] = []
    batches: list[np.ndarray] = []
    for path in map(Path, paths):
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                raise DpivonError(f"{path} holds no {'/'.join(IMAGE_SUFFIXES)} file")
        elif not os.path.lexists(path):
            raise DpivonError(f"{path} does not exist")
        elif path.suffix.lower() == ".npy":
            batch = _read_batch(path)
            names += [f"{path}[{i}]" for i in range(len(batch))]
            batches.append(batch)
            continue
        elif path.suffix.lower() in IMAGE_SUFFIXES:
            files = [path]
        else:
            raise DpivonError(f"{path}: not an image ({', '.join(IMAGE_SUFFIXES)}) or a .npy batch")
        names += [str(f) for f in files]
        batches.append(np.stack([_read_image(f) for f in files]))
    if not batches:
        raise DpivonError("no image given")
    kinds = {b.dtype.kind for b in batches}
    if len(kinds) > 1:
        raise DpivonError("mixing integer and float images: give them in separate calls")
    return names, np.concatenate(batches)


# Pillow's modes of 16-bit (and 32-bit integer) grey images, which its RGB conversion would
# clip at 255 (a 16-bit PNG read as white): scaled to 8 bits here instead
_WIDE_GREY_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N"})


def _rgb_pixels(image: Image.Image) -> np.ndarray:
    """(H, W, 3) uint8 pixels of ``image``; a 16-bit grey image's 0-65535 scaled to 0-255."""
    if image.mode not in _WIDE_GREY_MODES:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)
    grey = np.asarray(image, dtype=np.float64) / 257.0  # 65535 / 257 = 255
    return np.repeat(grey.round().clip(0, 255).astype(np.uint8)[..., None], 3, axis=2)


def _read_image(path: Path) -> np.ndarray:
    check_regular_file(path, "image")
    try:
        with Image.open(path) as image:
            pixels = _rgb_pixels(image)
    except (UnidentifiedImageError, OSError) as err:
        raise DpivonError(f"cannot read the image {path}: {err}") from None
    if pixels.shape != IMAGE_SHAPE:
        height, width = pixels.shape[:2]
        raise DpivonError(f"{path} is {width}x{height} pixels; the models take 32x32 images")
    return pixels


def _read_batch(path: Path) -> np.ndarray:
    check_regular_file(path, "batch")
    try:
        batch = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as err:
        raise DpivonError(f"cannot read the batch {path}: {err}") from None
    if not isinstance(batch, np.ndarray):  # an .npz archive: several arrays, not one batch
        raise DpivonError(f"{path} is an .npz archive of arrays; save the batch with np.save")
    if batch.ndim != 4 or batch.shape[1:] not in (IMAGE_SHAPE, CHANNELS_FIRST):
        raise DpivonError(f"{path}: a batch is (N, 32, 32, 3) or (N, 3, 32, 32), got {batch.shape}")
    return batch if batch.shape[1:] == IMAGE_SHAPE else batch.transpose(0, 2, 3, 1)
