"""CIFAR-10 and synthetic data: loading, caching, splits and tensor datasets."""

from dpivon.data.arrays import CIFAR10_CLASSES, ImageArrays
from dpivon.data.cifar10 import default_cache_dir, load_cifar10
from dpivon.data.splits import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    DATASETS,
    DataSplits,
    load_splits,
    load_test_images,
    stratified_subset,
    to_tensor_dataset,
    train_val_split,
)
from dpivon.data.synthetic import synthetic_cifar10

__all__ = [
    "CIFAR10_CLASSES",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "DATASETS",
    "DataSplits",
    "ImageArrays",
    "default_cache_dir",
    "load_cifar10",
    "load_splits",
    "load_test_images",
    "stratified_subset",
    "synthetic_cifar10",
    "to_tensor_dataset",
    "train_val_split",
]
