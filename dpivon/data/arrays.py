"""In-memory image arrays and the class-stratified index selection shared by all loaders."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpivon.errors import DpivonError

# Alphabetical, which is also the label order of the original CIFAR-10 release.
CIFAR10_CLASSES: tuple[str, ...] = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
IMAGE_SHAPE: tuple[int, int, int] = (32, 32, 3)


@dataclass(frozen=True)
class ImageArrays:
    """A labelled image set: uint8 images (N, 32, 32, 3), int64 labels (N,), class names."""

    images: np.ndarray
    labels: np.ndarray
    classes: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.images.dtype != np.uint8 or self.images.shape[1:] != IMAGE_SHAPE:
            raise DpivonError(
                f"images must be uint8 with shape (N, 32, 32, 3), got {self.images.dtype} "
                f"{self.images.shape}; convert the data to 32x32 RGB uint8 first"
            )
        if self.labels.dtype != np.int64 or self.labels.shape != (len(self.images),):
            raise DpivonError(
                f"labels must be int64 with shape ({len(self.images)},), got {self.labels.dtype} "
                f"{self.labels.shape}; pass one integer label per image"
            )
        if len(self.labels) and (self.labels.min() < 0 or self.labels.max() >= len(self.classes)):
            raise DpivonError(
                f"labels must lie in [0, {len(self.classes)}) to index the {len(self.classes)} "
                "class names; fix the labels or the class list"
            )

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, indices: np.ndarray) -> ImageArrays:
        """The images at `indices`, in that order."""
        return ImageArrays(self.images[indices], self.labels[indices], self.classes)


def class_counts(arrays: ImageArrays) -> np.ndarray:
    """Number of images per class index (length = number of classes)."""
    return np.bincount(arrays.labels, minlength=len(arrays.classes))


def stratified_indices(
    labels: np.ndarray, per_class_counts: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Sorted indices holding `per_class_counts[c]` randomly chosen images of each class c."""
    chosen = [
        rng.permutation(np.flatnonzero(labels == c))[:count]
        for c, count in enumerate(per_class_counts)
    ]
    return np.sort(np.concatenate(chosen)) if chosen else np.empty(0, dtype=np.int64)
