"""Tests for dpivon.data: loading, caching, source resolution, splits and synthetic data."""

from __future__ import annotations

import os
import shutil
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dpivon.data import (
    CIFAR10_CLASSES,
    CIFAR10_MEAN,
    CIFAR10_STD,
    ImageArrays,
    load_cifar10,
    load_splits,
    stratified_subset,
    synthetic_cifar10,
    to_tensor_dataset,
    train_val_split,
)
from dpivon.errors import DpivonError

REPO = Path(__file__).resolve().parents[1]
# Read before the autouse fixture clears it: CI may point DPIVON_DATA at the real tarball.
REAL_DATA_ENV = os.environ.get("DPIVON_DATA")
N_TRAIN, N_TEST = 3, 2  # images per class in the tiny data set


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the caller's DPIVON_DATA or writes to the real ~/.cache."""
    monkeypatch.delenv("DPIVON_DATA", raising=False)
    monkeypatch.setenv("DPIVON_CACHE", str(tmp_path / "default-cache"))


def _colour(split: str, label: int, index: int) -> tuple[int, int, int]:
    """A distinct solid colour per image; solid colours survive JPEG almost exactly."""
    offset = 0 if split == "train" else 120
    return (20 * label + 10, 40 * index + offset, 250 - 20 * label)


def _write_image_folder(root: Path, classes: tuple[str, ...] = CIFAR10_CLASSES) -> Path:
    for split, count in (("train", N_TRAIN), ("test", N_TEST)):
        for label, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for index in range(count):
                image = Image.new("RGB", (32, 32), _colour(split, label, index))
                image.save(folder / f"{index:04d}.jpg", quality=95)
    return root


def _expected(split: str) -> tuple[np.ndarray, np.ndarray]:
    count = N_TRAIN if split == "train" else N_TEST
    colours = [_colour(split, c, i) for c in range(len(CIFAR10_CLASSES)) for i in range(count)]
    images = np.array(colours, dtype=np.float64)[:, None, None, :] * np.ones((1, 32, 32, 1))
    return images, np.repeat(np.arange(len(CIFAR10_CLASSES)), count)


def _make_tarball(tmp_path: Path, top: str = "mini-cifar") -> Path:
    folder = _write_image_folder(tmp_path / "build" / top)
    tarball = tmp_path / "mini.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(folder, arcname=top)
    return tarball


@pytest.fixture
def tarball(tmp_path: Path) -> Path:
    return _make_tarball(tmp_path)


def _assert_same(a: tuple[ImageArrays, ImageArrays], b: tuple[ImageArrays, ImageArrays]) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.images, y.images)
        np.testing.assert_array_equal(x.labels, y.labels)
        assert x.classes == y.classes


def _indexed(per_class: int) -> ImageArrays:
    """Balanced arrays whose first two pixel bytes encode the image index, for identity checks."""
    n = per_class * len(CIFAR10_CLASSES)
    images = np.zeros((n, 32, 32, 3), dtype=np.uint8)
    images[:, 0, 0, 0] = np.arange(n) // 256
    images[:, 0, 0, 1] = np.arange(n) % 256
    return ImageArrays(images, np.arange(n, dtype=np.int64) % 10, CIFAR10_CLASSES)


def _ids(arrays: ImageArrays) -> np.ndarray:
    return arrays.images[:, 0, 0, 0].astype(np.int64) * 256 + arrays.images[:, 0, 0, 1]


# --- loading -------------------------------------------------------------------------------


def test_tarball_loads_shapes_labels_and_pixels(tarball: Path, tmp_path: Path) -> None:
    train, test = load_cifar10(tarball, cache_dir=tmp_path / "cache")
    for arrays, split in ((train, "train"), (test, "test")):
        images, labels = _expected(split)
        assert arrays.images.dtype == np.uint8 and arrays.labels.dtype == np.int64
        assert arrays.images.shape == images.shape
        assert len(arrays) == len(labels)
        np.testing.assert_array_equal(arrays.labels, labels)
        assert arrays.classes == CIFAR10_CLASSES
        # JPEG is lossy, but a solid colour comes back within a few levels.
        assert np.abs(arrays.images.astype(np.float64) - images).max() <= 4


def test_extracted_folder_and_its_parent_match_tarball(tarball: Path, tmp_path: Path) -> None:
    from_tar = load_cifar10(tarball, cache_dir=tmp_path / "cache")
    folder = tmp_path / "build" / "mini-cifar"
    _assert_same(load_cifar10(folder, cache_dir=tmp_path / "cache"), from_tar)
    _assert_same(load_cifar10(folder.parent, cache_dir=tmp_path / "cache"), from_tar)


def test_parent_dir_of_tarball_resolves_to_it(tarball: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "README.md").write_text("not data")
    moved = shutil.move(tarball, shared / "cifar10-jpeg.tgz")
    _assert_same(load_cifar10(shared), load_cifar10(moved))


def test_second_load_is_served_from_cache(tarball: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = load_cifar10(tarball, cache_dir=cache)
    [cache_file] = cache.glob("cifar10-*.npz")
    assert not list(cache.glob("*.tmp"))  # the atomic write left no temp file behind
    # Garbage with the same path, size and mtime: only a cache hit can still load it.
    stat = tarball.stat()
    tarball.write_bytes(b"\0" * stat.st_size)
    os.utime(tarball, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    _assert_same(load_cifar10(tarball, cache_dir=cache), first)
    assert list(cache.glob("cifar10-*.npz")) == [cache_file]


def test_changed_source_is_decoded_again(tarball: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first, _ = load_cifar10(tarball, cache_dir=cache)
    mtime = tarball.stat().st_mtime_ns
    folder = tmp_path / "build" / "mini-cifar"
    Image.new("RGB", (32, 32), (0, 0, 0)).save(folder / "train" / "airplane" / "0000.jpg")
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(folder, arcname="mini-cifar")
    os.utime(tarball, ns=(mtime, mtime + 10**9))  # a new mtime even on coarse-clock filesystems
    changed, _ = load_cifar10(tarball, cache_dir=cache)
    assert first.images[0].max() > 200 and changed.images[0].max() <= 4
    np.testing.assert_array_equal(changed.images[1:], first.images[1:])
    assert len(list(cache.glob("cifar10-*.npz"))) == 2


def test_cache_dir_is_the_fallback_source(tarball: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = load_cifar10(tarball, cache_dir=cache)
    tarball.unlink()
    _assert_same(load_cifar10(cache_dir=cache), first)
    # An explicit path is never silently replaced by the cache.
    with pytest.raises(DpivonError, match="does not exist"):
        load_cifar10(tarball, cache_dir=cache)


def test_env_vars_choose_source_and_cache(
    tarball: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPIVON_DATA", str(tarball))
    monkeypatch.setenv("DPIVON_CACHE", str(tmp_path / "env-cache"))
    from_env = load_cifar10()
    assert len(list((tmp_path / "env-cache").glob("cifar10-*.npz"))) == 1
    _assert_same(from_env, load_cifar10(tarball, cache_dir=tmp_path / "cache"))
    # An explicit path takes precedence over DPIVON_DATA, which is used as is when set.
    monkeypatch.setenv("DPIVON_DATA", str(tmp_path / "nowhere"))
    _assert_same(load_cifar10(tarball), from_env)
    with pytest.raises(DpivonError, match=r"DPIVON_DATA .*nowhere does not exist"):
        load_cifar10()


@pytest.mark.parametrize("cache", ["/proc/dpivon-cache", "{file}/cache"])
def test_an_unusable_cache_is_refused_before_the_decoding(
    tarball: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: str
) -> None:
    regular = tmp_path / "a-file"
    regular.write_text("")
    monkeypatch.setenv("DPIVON_CACHE", cache.format(file=regular))

    def decode(*args, **kwargs):
        raise AssertionError("decoded before the cache was checked")

    monkeypatch.setattr("dpivon.data.cifar10._decode", decode)
    with pytest.raises(DpivonError, match=r"^\$DPIVON_CACHE .*cache"):
        load_cifar10(tarball)


def test_missing_path_and_nothing_found(tmp_path: Path) -> None:
    with pytest.raises(DpivonError, match=r"does not exist; pass --data-path or set DPIVON_DATA"):
        load_cifar10(tmp_path / "missing.tar.gz")
    cache = tmp_path / "empty-cache"
    with pytest.raises(DpivonError) as info:
        load_cifar10(cache_dir=cache)
    message = str(info.value)
    assert str(cache) in message and "DPIVON_DATA" in message
    assert "../shared/data/cifar10-jpeg.tar.gz" in message


def test_wrong_layouts_are_reported(tmp_path: Path) -> None:
    not_data = tmp_path / "not-data"
    (not_data / "images").mkdir(parents=True)
    with pytest.raises(DpivonError, match=r"not-data is not a CIFAR-10 source.*ImageFolder"):
        load_cifar10(not_data)

    renamed = ("aeroplane", *CIFAR10_CLASSES[1:])
    wrong_classes = _write_image_folder(tmp_path / "wrong-classes", classes=renamed)
    with pytest.raises(DpivonError, match=r"wrong-classes.*class folders.*aeroplane"):
        load_cifar10(wrong_classes)

    big = _write_image_folder(tmp_path / "big")
    Image.new("RGB", (64, 64)).save(big / "test" / "cat" / "0000.jpg")
    with pytest.raises(DpivonError, match=r"test/cat/0000.jpg is 64x64, not 32x32"):
        load_cifar10(big)

    text_file = tmp_path / "data.zip"
    text_file.write_text("zip")
    with pytest.raises(DpivonError, match=r"data.zip is not a CIFAR-10 source"):
        load_cifar10(text_file)

    broken = tmp_path / "broken.tar.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(DpivonError, match=r"cannot read .*broken.tar.gz"):
        load_cifar10(broken)

    only_train = tmp_path / "only-train"
    with tarfile.open(only_train.with_suffix(".tgz"), "w:gz") as tar:
        tar.add(_write_image_folder(tmp_path / "x") / "train", arcname="cifar/train")
    with pytest.raises(DpivonError, match=r"no train/ and test/ image folders"):
        load_cifar10(only_train.with_suffix(".tgz"))

    release = tmp_path / "release"
    (release / "cifar-10-batches-py").mkdir(parents=True)
    (release / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"junk")
    with pytest.raises(DpivonError, match=r"cannot read the CIFAR-10 release"):
        load_cifar10(release)


def test_image_arrays_validates_shapes() -> None:
    with pytest.raises(DpivonError, match="32, 32, 3"):
        ImageArrays(np.zeros((2, 28, 28, 3), np.uint8), np.zeros(2, np.int64), CIFAR10_CLASSES)
    with pytest.raises(DpivonError, match="labels must lie"):
        ImageArrays(np.zeros((1, 32, 32, 3), np.uint8), np.array([10]), CIFAR10_CLASSES)


# --- splits and subsets --------------------------------------------------------------------


def test_train_val_split_is_stratified_disjoint_and_seeded() -> None:
    data = _indexed(per_class=40)
    train, val = train_val_split(data, val_size=55, seed=3)
    assert (len(train), len(val)) == (345, 55)
    assert set(_ids(train)).isdisjoint(_ids(val))
    assert set(_ids(train)) | set(_ids(val)) == set(range(400))
    counts = np.bincount(val.labels, minlength=10)
    assert counts.sum() == 55 and counts.max() - counts.min() <= 1
    np.testing.assert_array_equal(_ids(train_val_split(data, 55, seed=3)[1]), _ids(val))
    assert not np.array_equal(_ids(train_val_split(data, 55, seed=4)[1]), _ids(val))
    for bad in (0, -1, 400, 401):
        with pytest.raises(DpivonError, match="val_size must be between 1 and 399"):
            train_val_split(data, val_size=bad)


def test_stratified_subset_counts_and_errors() -> None:
    data = _indexed(per_class=20)
    subset = stratified_subset(data, per_class=7, seed=1)
    np.testing.assert_array_equal(np.bincount(subset.labels), np.full(10, 7))
    assert len(set(_ids(subset))) == 70
    np.testing.assert_array_equal(_ids(stratified_subset(data, 7, seed=1)), _ids(subset))
    with pytest.raises(DpivonError, match=r"too few images in airplane \(20\)"):
        stratified_subset(data, per_class=21)
    with pytest.raises(DpivonError, match="at least 1"):
        stratified_subset(data, per_class=0)


# --- synthetic data and tensors ------------------------------------------------------------


def test_synthetic_is_balanced_deterministic_and_learnable() -> None:
    train, test = synthetic_cifar10(n_train=1000, n_test=200, seed=0)
    assert train.images.shape == (1000, 32, 32, 3) and test.images.shape == (200, 32, 32, 3)
    assert train.images.dtype == np.uint8 and train.classes == CIFAR10_CLASSES
    np.testing.assert_array_equal(np.bincount(train.labels), np.full(10, 100))
    np.testing.assert_array_equal(np.bincount(test.labels), np.full(10, 20))
    again, _ = synthetic_cifar10(1000, 200, seed=0)
    np.testing.assert_array_equal(again.images, train.images)
    assert not np.array_equal(synthetic_cifar10(1000, 200, seed=1)[0].images, train.images)
    # Learnable: even a nearest-class-mean classifier generalises to the test set.
    flat = train.images.reshape(len(train), -1).astype(np.float64)
    means = np.stack([flat[train.labels == c].mean(0) for c in range(10)])
    test_flat = test.images.reshape(len(test), -1).astype(np.float64)
    predicted = ((test_flat[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (predicted == test.labels).mean() > 0.9
    with pytest.raises(DpivonError, match="n_test must be at least 10"):
        synthetic_cifar10(100, 5)


def test_to_tensor_dataset_normalises_nchw() -> None:
    images = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    images[0, ..., 0], images[0, ..., 1], images[0, ..., 2] = 255, 128, 0
    dataset = to_tensor_dataset(ImageArrays(images, np.array([3, 7]), CIFAR10_CLASSES))
    x, y = dataset.tensors
    assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == [3, 7]
    expected = [
        (v / 255 - m) / s for v, m, s in zip((255, 128, 0), CIFAR10_MEAN, CIFAR10_STD, strict=True)
    ]
    for channel in range(3):
        torch.testing.assert_close(x[0, channel], torch.full((32, 32), expected[channel]))
        torch.testing.assert_close(
            x[1, channel], torch.full((32, 32), -CIFAR10_MEAN[channel] / CIFAR10_STD[channel])
        )


def test_load_splits(tarball: Path) -> None:
    splits = load_splits("synthetic", val_size=200, per_class=50, seed=2)
    assert [len(d) for d in (splits.train, splits.val, splits.test)] == [500, 200, 200]
    assert splits.classes == CIFAR10_CLASSES
    assert torch.bincount(splits.val.tensors[1]).tolist() == [20] * 10

    real = load_splits("cifar10", data_path=tarball, val_size=10, per_class=1)
    assert [len(d) for d in (real.train, real.val, real.test)] == [10, 10, 20]
    assert real.train.tensors[0].shape == (10, 3, 32, 32)

    with pytest.raises(DpivonError, match="choose one of cifar10, synthetic"):
        load_splits("mnist")
    with pytest.raises(DpivonError, match="val_size"):
        load_splits("synthetic")  # default val_size 5000 > 1000 synthetic training images


# --- the real data set ---------------------------------------------------------------------


@pytest.mark.slow
def test_real_cifar10_tarball(tmp_path: Path) -> None:
    candidates = [Path(p) for p in (REAL_DATA_ENV,) if p]
    candidates.append(REPO.parent / "shared" / "data" / "cifar10-jpeg.tar.gz")
    found = [p for p in candidates if p.exists()]
    if not found:
        pytest.fail(
            f"real CIFAR-10 tarball not found at {', '.join(map(str, candidates))}; "
            "set DPIVON_DATA to cifar10-jpeg.tar.gz (CI provides it)"
        )
    cache = tmp_path / "real-cache"
    start = time.perf_counter()
    train, test = load_cifar10(found[0], cache_dir=cache)
    decode_s = time.perf_counter() - start
    start = time.perf_counter()
    cached_train, _ = load_cifar10(found[0], cache_dir=cache)
    cached_s = time.perf_counter() - start
    print(f"real CIFAR-10: decode {decode_s:.1f} s, cached load {cached_s:.2f} s")

    assert train.images.shape == (50_000, 32, 32, 3) and test.images.shape == (10_000, 32, 32, 3)
    np.testing.assert_array_equal(np.bincount(train.labels), np.full(10, 5000))
    np.testing.assert_array_equal(np.bincount(test.labels), np.full(10, 1000))
    assert train.classes == CIFAR10_CLASSES
    means = train.images.reshape(-1, 3).mean(axis=0) / 255
    np.testing.assert_allclose(means, (0.4913, 0.4821, 0.4465), atol=0.002)
    np.testing.assert_array_equal(cached_train.images, train.images)
    assert cached_s < 10
