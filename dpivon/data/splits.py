"""Validation splits, class-balanced subsets and the tensor datasets used for training."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from dpivon.config import DatasetName
from dpivon.data.arrays import ImageArrays, class_counts, stratified_indices
from dpivon.data.cifar10 import load_cifar10
from dpivon.data.synthetic import synthetic_cifar10
from dpivon.errors import DpivonError

CIFAR10_MEAN: tuple[float, float, float] = (0.4914, 0.4822, 0.4465)
CIFAR10_STD: tuple[float, float, float] = (0.2470, 0.2435, 0.2616)
DATASETS: tuple[str, ...] = get_args(DatasetName)


def train_val_split(
    train: ImageArrays, val_size: int = 5000, seed: int = 0
) -> tuple[ImageArrays, ImageArrays]:
    """Split off a seeded, class-stratified validation set of exactly `val_size` images.

    Each class gives images in proportion to its share of `train` (largest-remainder
    rounding), so a balanced set yields a balanced validation set. Both parts keep the
    original image order.
    """
    if not 0 < val_size < len(train):
        raise DpivonError(
            f"val_size must be between 1 and {len(train) - 1} for {len(train)} training "
            f"images, got {val_size}; pass a val_size in that range"
        )
    counts = class_counts(train)
    quotas = counts * val_size / len(train)
    val_counts = np.floor(quotas).astype(np.int64)
    # Hand the rounding remainder to the classes with the largest fractional parts; the
    # stable sort breaks ties by class index so the split is deterministic.
    by_fraction = np.argsort(-(quotas - val_counts), kind="stable")
    val_counts[by_fraction[: val_size - val_counts.sum()]] += 1
    val_idx = stratified_indices(train.labels, val_counts, np.random.default_rng(seed))
    in_val = np.zeros(len(train), dtype=bool)
    in_val[val_idx] = True
    return train.take(np.flatnonzero(~in_val)), train.take(val_idx)


def stratified_subset(arrays: ImageArrays, per_class: int, seed: int = 0) -> ImageArrays:
    """A seeded subset with exactly `per_class` images of every class, in original order."""
    if per_class < 1:
        raise DpivonError(f"per_class must be at least 1, got {per_class}; pass a positive count")
    counts = class_counts(arrays)
    short = [f"{arrays.classes[c]} ({n})" for c, n in enumerate(counts) if n < per_class]
    if short:
        raise DpivonError(
            f"cannot take {per_class} images per class: too few images in {', '.join(short)}; "
            f"pass per_class <= {counts.min()}"
        )
    per_class_counts = np.full(len(counts), per_class, dtype=np.int64)
    return arrays.take(
        stratified_indices(arrays.labels, per_class_counts, np.random.default_rng(seed))
    )


def cifar_normalise_(images: Tensor) -> Tensor:
    """In place: float NCHW pixels in [0, 1] minus the CIFAR-10 mean, over its std."""
    mean = torch.tensor(CIFAR10_MEAN, dtype=images.dtype).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD, dtype=images.dtype).view(1, 3, 1, 1)
    return images.sub_(mean).div_(std)


def to_tensor_dataset(arrays: ImageArrays) -> TensorDataset:
    """float32 NCHW images normalised with the CIFAR-10 mean/std, and int64 labels."""
    images = torch.empty((len(arrays), 3, 32, 32), dtype=torch.float32)
    # copy_ converts dtype and layout in one pass, keeping peak memory at one float copy.
    images.copy_(torch.from_numpy(arrays.images).permute(0, 3, 1, 2))
    cifar_normalise_(images.div_(255.0))
    return TensorDataset(images, torch.from_numpy(arrays.labels.copy()))


def _load_arrays(
    dataset: str, data_path: str | Path | None, seed: int, synthetic_sizes: tuple[int, int]
) -> tuple[ImageArrays, ImageArrays]:
    if dataset == "cifar10":
        return load_cifar10(data_path)
    if dataset == "synthetic":
        return synthetic_cifar10(*synthetic_sizes, seed=seed)
    raise DpivonError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")


def load_test_images(
    dataset: str,
    *,
    data_path: str | Path | None = None,
    seed: int = 0,
    synthetic_sizes: tuple[int, int] = (1000, 200),
) -> ImageArrays:
    """The uint8 test images of `dataset`, the ones `load_splits` makes its test set of."""
    return _load_arrays(dataset, data_path, seed, synthetic_sizes)[1]


@dataclass(frozen=True)
class DataSplits:
    """Train, validation and test tensor datasets plus the class names, and the uint8
    validation and test images the tensors were made from (what corruptions start from,
    `dpivon.evaluation.shift`)."""

    train: TensorDataset
    val: TensorDataset
    test: TensorDataset
    classes: tuple[str, ...]
    val_images: ImageArrays | None = None
    test_images: ImageArrays | None = None


def load_splits(
    dataset: str,
    *,
    data_path: str | Path | None = None,
    val_size: int = 5000,
    per_class: int | None = None,
    seed: int = 0,
    synthetic_sizes: tuple[int, int] = (1000, 200),
) -> DataSplits:
    """Load `dataset` ("cifar10" or "synthetic") as train/validation/test tensor datasets.

    The validation set is split off the training images first (`val_size` images, exact,
    stratified); `per_class` then subsamples only the remaining training part, so for small
    subsets pass a correspondingly small `val_size`. The test set is never subsampled.
    `synthetic_sizes` is (n_train, n_test) for "synthetic", where `val_size` must be
    smaller than n_train. `data_path` is passed to `load_cifar10`.
    """
    train, test = _load_arrays(dataset, data_path, seed, synthetic_sizes)
    train, val = train_val_split(train, val_size=val_size, seed=seed)
    if per_class is not None:
        train = stratified_subset(train, per_class, seed=seed)
    return DataSplits(
        train=to_tensor_dataset(train),
        val=to_tensor_dataset(val),
        test=to_tensor_dataset(test),
        classes=train.classes,
        val_images=val,
        test_images=test,
    )
