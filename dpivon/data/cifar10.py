"""Locate, decode and cache CIFAR-10 as uint8 arrays.

Sources (see `load_cifar10`): an ImageFolder-layout JPEG tarball or directory, or the
original python release read through torchvision. Whatever the source, the decoded arrays
are cached once as an uncompressed ``.npz`` so later loads take about a second.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

import numpy as np
from PIL import Image, UnidentifiedImageError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dpivon.data.arrays import CIFAR10_CLASSES, IMAGE_SHAPE, ImageArrays
from dpivon.errors import DpivonError
from dpivon.paths import DATA_ENV, DATA_HOW_TO_FIX, check_writable_folder, named_data_path

ENV_CACHE = "DPIVON_CACHE"
RELEASE_DIR = "cifar-10-batches-py"
# Part of every cache key: bump it when decoding changes so stale caches are rebuilt.
_CACHE_VERSION = 1
_SPLITS = ("train", "test")
_CACHED = ("train_images", "train_labels", "test_images", "test_labels", "classes")
_TAR_SUFFIXES = (".tar.gz", ".tgz")
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")
_LAYOUT = (
    "expected a .tar.gz/.tgz archive or a directory in ImageFolder layout "
    "<root>/{train,test}/<class>/<image> with the 10 CIFAR-10 class folders "
    f"({', '.join(CIFAR10_CLASSES)}) and 32x32 images, or a directory holding the original "
    f"release folder {RELEASE_DIR}"
)


@dataclass(frozen=True)
class _Source:
    """A resolved data source; for "release", `path` is the folder above cifar-10-batches-py."""

    kind: Literal["tar", "folder", "release"]
    path: Path


@dataclass(frozen=True)
class _Entry:
    """One encoded image found in a source, before decoding."""

    split: str
    label: str
    name: str
    data: bytes


def default_cache_dir() -> Path:
    """`$DPIVON_CACHE` if set, else ~/.cache/dpivon."""
    return Path(os.environ.get(ENV_CACHE) or "~/.cache/dpivon").expanduser()


def load_cifar10(
    path: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    download: bool = False,
) -> tuple[ImageArrays, ImageArrays]:
    """Load CIFAR-10 as (train, test) uint8 arrays, decoding once and caching the result.

    The source is the first of: `path`; the `DPIVON_DATA` environment variable; the cache
    directory (`cache_dir`, else `$DPIVON_CACHE`, else ~/.cache/dpivon), which serves the
    most recently decoded copy or a cifar-10-batches-py folder; with `download=True`, a
    torchvision download into the cache directory. A given path or `DPIVON_DATA` is used
    as is, never silently replaced by the cache. It may be a .tar.gz/.tgz of the
    ImageFolder layout ``<root>/{train,test}/<class>/<image>``, such a directory or its
    parent, or a directory holding the original release (cifar-10-batches-py).
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    named = named_data_path(path)
    if named is not None:
        return _load_source(_resolve(*named), cache)
    for cache_file in sorted(cache.glob("cifar10-*.npz"), key=_mtime, reverse=True):
        cached = _read_cache(cache_file)
        if cached is not None:
            return cached
    if (cache / RELEASE_DIR).is_dir():
        return _load_source(_Source("release", cache), cache)
    looked = (
        f"no data path was given, {DATA_ENV} is not set, and the cache directory {cache} "
        f"holds no decoded copy and no {RELEASE_DIR} folder"
    )
    if not download:
        raise DpivonError(
            f"CIFAR-10 not found: {looked}; {DATA_HOW_TO_FIX}, or allow the download on a "
            "machine with internet access"
        )
    _download(cache, looked)
    return _load_source(_Source("release", cache), cache)


def _mtime(path: Path) -> int:
    return path.stat().st_mtime_ns


def _resolve(path: Path, origin: str) -> _Source:
    """Work out what kind of source `path` (which exists: `named_data_path`) is, or explain
    why it is not one."""
    if path.is_file():
        if path.name.endswith(_TAR_SUFFIXES):
            return _Source("tar", path)
        raise DpivonError(f"{origin} {path} is not a CIFAR-10 source: {_LAYOUT}")
    if all((path / split).is_dir() for split in _SPLITS):
        return _Source("folder", path)
    if path.name == RELEASE_DIR:
        return _Source("release", path.parent)
    if (path / RELEASE_DIR).is_dir():
        return _Source("release", path)
    # A parent folder works too, e.g. one holding cifar10-jpeg/ or cifar10-jpeg.tar.gz.
    children = [
        child
        for child in sorted(path.iterdir())
        if (child.is_dir() and all((child / split).is_dir() for split in _SPLITS))
        or (child.is_file() and child.name.endswith(_TAR_SUFFIXES))
    ]
    if len(children) == 1:
        return _resolve(children[0], origin)
    if children:
        found = f"several candidates ({', '.join(c.name for c in children)})"
    else:
        found = "no train/ and test/ folders"
    raise DpivonError(
        f"{origin} {path} is not a CIFAR-10 source, it has {found}: {_LAYOUT}; "
        "point the path at one data set"
    )


def _load_source(source: _Source, cache: Path) -> tuple[ImageArrays, ImageArrays]:
    cache_file = cache / f"cifar10-{_cache_key(source)}.npz"
    cached = _read_cache(cache_file)
    if cached is not None:
        return cached
    # the decoded copy is written there: an unusable folder fails now, not after the decoding
    origin = f"${ENV_CACHE}" if os.environ.get(ENV_CACHE) else "the cache directory"
    check_writable_folder(cache, origin)
    train, test = _decode(source)
    _write_cache(cache_file, train, test)
    return train, test


def _cache_key(source: _Source) -> str:
    """Hash of the source's path, size and modification time: a changed source re-decodes."""
    if source.kind == "tar":
        stat = source.path.stat()
        size, mtime, count = stat.st_size, stat.st_mtime_ns, 1
    else:
        # A directory's own mtime misses edits to files inside, so take every file's.
        root = source.path / RELEASE_DIR if source.kind == "release" else source.path
        stats = [(root / d / f).stat() for d, _, files in os.walk(root) for f in files]
        size = sum(s.st_size for s in stats)
        mtime = max((s.st_mtime_ns for s in stats), default=0)
        count = len(stats)
    text = f"{_CACHE_VERSION}|{source.kind}|{source.path.resolve()}|{size}|{mtime}|{count}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read_cache(cache_file: Path) -> tuple[ImageArrays, ImageArrays] | None:
    """The cached arrays, or None when the file is missing or unusable (then it is rebuilt)."""
    npz = read_npz(cache_file, _CACHED)
    if npz is None:
        return None
    classes = tuple(str(c) for c in npz["classes"])
    try:
        return (
            ImageArrays(npz["train_images"], npz["train_labels"], classes),
            ImageArrays(npz["test_images"], npz["test_labels"], classes),
        )
    except DpivonError:
        return None


def read_npz(path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The arrays ``keys`` of a cached ``.npz``, or None when it is missing or unusable."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as npz:
            return {key: npz[key] for key in keys}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None


def _write_cache(cache_file: Path, train: ImageArrays, test: ImageArrays) -> None:
    arrays = {
        "train_images": train.images,
        "train_labels": train.labels,
        "test_images": test.images,
        "test_labels": test.labels,
        "classes": np.array(train.classes),
    }
    write_npz(cache_file, arrays)


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write a cache ``.npz`` via a temp file and rename, so readers (other runs) never see
    a partial file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp", delete=False
        ) as tmp:
            try:
                np.savez(tmp, **arrays)
            except BaseException:
                Path(tmp.name).unlink()
                raise
        os.replace(tmp.name, path)
    except OSError as exc:
        raise DpivonError(
            f"cannot write the cache file {path} ({exc}); set {ENV_CACHE} to a writable directory"
        ) from exc


def _decode(source: _Source) -> tuple[ImageArrays, ImageArrays]:
    if source.kind == "release":
        return _load_release(source.path)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        if source.kind == "tar":
            entries = _read_tar(source.path, progress)
        else:
            entries = _read_folder(source.path, progress)
        return _decode_entries(entries, source.path, progress)


def _read_tar(path: Path, progress: Progress) -> list[_Entry]:
    """Collect the encoded images of the one <root>/{train,test}/<class>/ tree in `path`."""
    task = progress.add_task(f"Reading {path.name} (bytes)", total=path.stat().st_size)
    by_root: dict[tuple[str, ...], list[_Entry]] = {}
    try:
        # Streaming mode reads the archive once, front to back, without extracting to disk.
        with path.open("rb") as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
            for member in tar:
                parts = PurePosixPath(member.name).parts
                if member.isfile() and len(parts) >= 3 and _is_image_name(parts[-1]):
                    split, label, name = parts[-3:]
                    if split in _SPLITS:
                        blob = tar.extractfile(member)
                        assert blob is not None  # isfile() members always have data
                        by_root.setdefault(parts[:-3], []).append(
                            _Entry(split, label, name, blob.read())
                        )
                progress.update(task, completed=raw.tell())
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise DpivonError(f"cannot read {path} as a .tar.gz archive ({exc}); {_LAYOUT}") from exc
    roots = [root for root, found in by_root.items() if {e.split for e in found} == set(_SPLITS)]
    if len(roots) != 1:
        problem = "several data sets" if roots else "no train/ and test/ image folders"
        raise DpivonError(f"archive {path} holds {problem}: {_LAYOUT}")
    return by_root[roots[0]]


def _read_folder(root: Path, progress: Progress) -> list[_Entry]:
    files = [
        (split, class_dir.name, image)
        for split in _SPLITS
        for class_dir in sorted((root / split).iterdir())
        if class_dir.is_dir()
        for image in sorted(class_dir.iterdir())
        if image.is_file() and _is_image_name(image.name)
    ]
    task = progress.add_task(f"Reading {root.name}/", total=len(files))
    entries = []
    for split, label, image in files:
        entries.append(_Entry(split, label, image.name, image.read_bytes()))
        progress.advance(task)
    return entries


def _is_image_name(name: str) -> bool:
    # Dot-files are metadata such as macOS "._0001.jpg" resource forks, not images.
    return not name.startswith(".") and name.lower().endswith(_IMAGE_SUFFIXES)


def _decode_entries(
    entries: list[_Entry], source: Path, progress: Progress
) -> tuple[ImageArrays, ImageArrays]:
    """Decode to RGB arrays, labelled by class-folder name in CIFAR-10 label order."""
    for split in _SPLITS:
        found = sorted({e.label for e in entries if e.split == split})
        if tuple(found) != CIFAR10_CLASSES:
            raise DpivonError(
                f"{source}: the {split}/ class folders are {found or 'missing'}, "
                f"not the 10 CIFAR-10 classes; {_LAYOUT}"
            )
    label_of = {name: i for i, name in enumerate(CIFAR10_CLASSES)}
    task = progress.add_task("Decoding CIFAR-10 images", total=len(entries))
    result = []
    for split in _SPLITS:
        # Sort by class then file name so a tarball and its extracted folder give equal arrays.
        chosen = sorted(
            (e for e in entries if e.split == split), key=lambda e: (label_of[e.label], e.name)
        )
        images = np.empty((len(chosen), *IMAGE_SHAPE), dtype=np.uint8)
        for i, entry in enumerate(chosen):
            images[i] = _decode_image(entry, source)
            progress.advance(task)
        labels = np.array([label_of[e.label] for e in chosen], dtype=np.int64)
        result.append(ImageArrays(images, labels, CIFAR10_CLASSES))
    return result[0], result[1]


def _decode_image(entry: _Entry, source: Path) -> np.ndarray:
    where = f"{source}: {entry.split}/{entry.label}/{entry.name}"
    try:
        with Image.open(io.BytesIO(entry.data)) as image:
            if image.size != IMAGE_SHAPE[:2]:
                raise DpivonError(
                    f"{where} is {image.size[0]}x{image.size[1]}, not 32x32; {_LAYOUT}"
                )
            return np.asarray(image.convert("RGB"))
    except (UnidentifiedImageError, OSError) as exc:
        raise DpivonError(f"{where} is not a readable image ({exc}); {_LAYOUT}") from exc


def _load_release(root: Path) -> tuple[ImageArrays, ImageArrays]:
    """Read the original python release through torchvision (which checks its checksums)."""
    from torchvision.datasets import CIFAR10  # slow import, needed only for this source

    result = []
    for train in (True, False):
        try:
            dataset = CIFAR10(str(root), train=train, download=False)
        except (RuntimeError, OSError, ValueError, pickle.UnpicklingError) as exc:
            raise DpivonError(
                f"cannot read the CIFAR-10 release in {root / RELEASE_DIR} ({exc}); "
                f"delete it and download again, or {DATA_HOW_TO_FIX}"
            ) from exc
        if tuple(dataset.classes) != CIFAR10_CLASSES:
            raise DpivonError(
                f"{root / RELEASE_DIR} has classes {dataset.classes}, not CIFAR-10's; {_LAYOUT}"
            )
        images = np.ascontiguousarray(dataset.data, dtype=np.uint8)
        result.append(ImageArrays(images, np.asarray(dataset.targets, np.int64), CIFAR10_CLASSES))
    return result[0], result[1]


def _download(cache: Path, looked: str) -> None:
    from torchvision.datasets import CIFAR10  # slow import, needed only for this source

    try:
        cache.mkdir(parents=True, exist_ok=True)
        CIFAR10(str(cache), train=True, download=True)
    # Network failures surface as many exception types (URLError, HTTPException, timeouts).
    except Exception as exc:
        raise DpivonError(
            f"CIFAR-10 not found and the download into {cache} failed ({exc}); {looked}; "
            f"{DATA_HOW_TO_FIX}"
        ) from exc
