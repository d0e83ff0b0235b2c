"""CIFAR-10-C-style corrupted test images (Hendrycks & Dietterich, ICLR 2019), made here.

The 19 corruptions of CIFAR-10-C (15, then the 4 extra ones: speckle noise, Gaussian blur,
spatter, saturate) at severities 1-5. The constants are CIFAR-10-C's for 32x32 images, from
the script that made it (`make_cifar_c.py`, hendrycks/robustness, ImageNet-C/create_c/):
they differ from the ImageNet-C constants that `imagecorruptions` hard-codes for every
corruption (the Gaussian noise std runs 0.08-0.38 over ImageNet-C's severities, 0.04-0.10
over CIFAR-10-C's). The library (`imagecorruptions-imaug` 1.1.5, the numpy-2 fork of
`imagecorruptions`) supplies what is more than a formula: the glass blur's pixel shuffle,
the defocus disk, the motion blur (its numpy kernel stands in for ImageMagick's), the zoom,
the fog's plasma fractal and the frost pictures. One exception: `spatter` is the library's
own function at ImageNet-C's constants (CIFAR-10-C's is another algorithm, not only other
constants).

Deterministic: every image draws from its own generator, seeded by the corruption, the
severity and the image's key (its index in the test set), so a subset of images is
corrupted exactly as in the full set, and one set is the same bytes on every machine with
the same library versions. Sets are cached beside the CIFAR-10 arrays (`load_corrupted`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from io import BytesIO
from pathlib import Path

import cv2
import numpy as np
from imagecorruptions import corruptions as library
from PIL import Image
from scipy.ndimage import map_coordinates
from skimage.color import hsv2rgb, rgb2hsv
from skimage.filters import gaussian
from skimage.util import random_noise

from dpivon.data.arrays import IMAGE_SHAPE, ImageArrays
from dpivon.data.cifar10 import default_cache_dir, read_npz, write_npz
from dpivon.errors import DpivonError

SEVERITIES = (1, 2, 3, 4, 5)
# Part of every cache key: bump it when a corruption changes so stale sets are rebuilt.
_CORRUPTION_VERSION = 1
_SIDE = IMAGE_SHAPE[0]

Corruption = Callable[[np.ndarray, object, np.random.Generator], np.ndarray]


def _unit(image: np.ndarray) -> np.ndarray:
    return image / 255.0


def _pixels(unit: np.ndarray) -> np.ndarray:
    """[0, 1] floats back to the 0-255 scale, clipped."""
    return np.clip(unit, 0.0, 1.0) * 255.0


def _blur(unit: np.ndarray, sigma: float) -> np.ndarray:
    return gaussian(unit, sigma=sigma, channel_axis=-1)


@contextmanager
def _global_numpy_seed(rng: np.random.Generator) -> Iterator[None]:
    """The library's fractal and spatter draw from numpy's global generator: seed it from
    ``rng`` for the call and give its state back, so training's stream is untouched."""
    state = np.random.get_state()
    np.random.seed(int(rng.integers(2**32)))
    try:
        yield
    finally:
        np.random.set_state(state)


def _centre_zoom(image: np.ndarray, factor: float) -> np.ndarray:
    """The library's zoom of the image's centre, trimmed to the centre as CIFAR-10-C does."""
    zoomed = library.clipped_zoom(image, factor)
    top = (zoomed.shape[0] - image.shape[0]) // 2
    return zoomed[top : top + image.shape[0], top : top + image.shape[1]]


def gaussian_noise(image: np.ndarray, std: float, rng: np.random.Generator) -> np.ndarray:
    unit = _unit(image)
    return _pixels(unit + rng.normal(scale=std, size=unit.shape))


def shot_noise(image: np.ndarray, photons: float, rng: np.random.Generator) -> np.ndarray:
    return _pixels(rng.poisson(_unit(image) * photons) / photons)


def impulse_noise(image: np.ndarray, amount: float, rng: np.random.Generator) -> np.ndarray:
    return _pixels(random_noise(_unit(image), mode="s&p", rng=rng, amount=amount))


def speckle_noise(image: np.ndarray, std: float, rng: np.random.Generator) -> np.ndarray:
    unit = _unit(image)
    return _pixels(unit + unit * rng.normal(scale=std, size=unit.shape))


def gaussian_blur(image: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    return _pixels(_blur(_unit(image), sigma))


def glass_blur(image: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    """Blur, shuffle pixels locally (``c``: sigma, max shift, iterations), blur again."""
    sigma = c[0]
    blurred = np.uint8(_blur(_unit(image), sigma) * 255)
    seed = int(rng.integers(2**31))
    shuffled = library._shuffle_pixels_njit_glass_blur(_SIDE, _SIDE, blurred, c, seed)
    return _pixels(_blur(_unit(shuffled), sigma))


def defocus_blur(image: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    """Convolution with an anti-aliased disk (``c``: radius, alias blur)."""
    kernel = library.disk(radius=c[0], alias_blur=c[1])
    return _pixels(cv2.filter2D(_unit(image), -1, kernel))


def motion_blur(image: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    """The library's motion blur (``c``: radius, sigma) in a random direction."""
    blurred = library._motion_blur(image, radius=c[0], sigma=c[1], angle=rng.uniform(-45, 45))
    return np.clip(blurred, 0, 255)


def zoom_blur(image: np.ndarray, largest: float, rng: np.random.Generator) -> np.ndarray:
    """The mean of the image and its zooms by 1, 1.01, ... up to ``largest`` (excluded)."""
    unit = _unit(image).astype(np.float32)
    zooms = [_centre_zoom(unit, factor) for factor in np.arange(1, largest, 0.01)]
    return _pixels((unit + np.sum(zooms, axis=0)) / (len(zooms) + 1))


def fog(image: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    """A plasma fractal (``c``: its weight, its decay) added, then rescaled to the maximum."""
    unit = _unit(image)
    peak = unit.max()
    with _global_numpy_seed(rng):
        fractal = library.plasma_fractal(mapsize=_SIDE, wibbledecay=c[1])
    fogged = unit + c[0] * fractal[:_SIDE, :_SIDE, None]
    return _pixels(fogged * peak / (peak + c[0]))


@functools.cache
def _frost_pictures() -> tuple[np.ndarray, ...]:
    """The library's first five frost pictures as RGB, shrunk to a fifth as CIFAR-10-C does."""
    pictures = []
    for name in ("frost1.png", "frost2.png", "frost3.png", "frost4.jpg", "frost5.jpg"):
        with importlib.resources.as_file(
            importlib.resources.files("imagecorruptions") / "frost" / name
        ) as path:
            bgr = cv2.imread(str(path))
        pictures.append(cv2.resize(bgr, (0, 0), fx=0.2, fy=0.2)[..., ::-1])
    return tuple(pictures)


def frost(image: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    """``c[0]`` image + ``c[1]`` a random 32x32 crop of a random frost picture."""
    picture = _frost_pictures()[rng.integers(5)]
    top = rng.integers(picture.shape[0] - _SIDE)
    left = rng.integers(picture.shape[1] - _SIDE)
    crop = picture[top : top + _SIDE, left : left + _SIDE]
    return np.clip(c[0] * image + c[1] * crop, 0, 255)


def snow(image: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    """Zoomed, thresholded, motion-blurred flakes over a greyed image. ``c``: flake mean,
    std, zoom, threshold, blur radius, blur sigma, share of the image kept."""
    unit = _unit(image).astype(np.float32)
    flakes = rng.normal(loc=c[0], scale=c[1], size=(_SIDE, _SIDE, 1))
    flakes = _centre_zoom(flakes, c[2])[..., 0]
    flakes = np.clip(np.where(flakes < c[3], 0.0, flakes), 0, 1)
    angle = rng.uniform(-135, -45)
    flakes = library._motion_blur(flakes, radius=c[4], sigma=c[5], angle=angle)
    flakes = (np.round(flakes * 255) / 255)[..., None]  # CIFAR-10-C's layer is 8-bit
    grey = cv2.cvtColor(unit, cv2.COLOR_RGB2GRAY)[..., None]
    greyed = c[6] * unit + (1 - c[6]) * np.maximum(unit, grey * 1.5 + 0.5)
    return _pixels(greyed + flakes + np.rot90(flakes, k=2))


def spatter(image: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    """The library's spatter at ImageNet-C's constants (see the module docstring); where
    its water layer comes out empty it divides 0 by 0, and the image stays as it was."""
    with _global_numpy_seed(rng), np.errstate(invalid="ignore"):
        spattered = library.spatter(Image.fromarray(image), severity)
    return np.where(np.isnan(spattered), image, spattered)


def contrast(image: np.ndarray, factor: float, rng: np.random.Generator) -> np.ndarray:
    unit = _unit(image)
    means = unit.mean(axis=(0, 1), keepdims=True)
    return _pixels((unit - means) * factor + means)


def brightness(image: np.ndarray, shift: float, rng: np.random.Generator) -> np.ndarray:
    hsv = rgb2hsv(_unit(image))
    hsv[..., 2] = np.clip(hsv[..., 2] + shift, 0, 1)
    return _pixels(hsv2rgb(hsv))


def saturate(image: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    """Saturation times ``c[0]`` plus ``c[1]``."""
    hsv = rgb2hsv(_unit(image))
    hsv[..., 1] = np.clip(hsv[..., 1] * c[0] + c[1], 0, 1)
    return _pixels(hsv2rgb(hsv))


def jpeg_compression(image: np.ndarray, quality: int, rng: np.random.Generator) -> np.ndarray:
    encoded = BytesIO()
    Image.fromarray(image).save(encoded, "JPEG", quality=quality)
    with Image.open(encoded) as decoded:
        return np.asarray(decoded.convert("RGB"))


def pixelate(image: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
    small = int(_SIDE * scale)
    shrunk = Image.fromarray(image).resize((small, small), Image.BOX)
    return np.asarray(shrunk.resize((_SIDE, _SIDE), Image.BOX))


def elastic_transform(image: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    """A random affine warp (corners moved by up to ``c[2]`` pixels), then a smooth random
    displacement field (std ``c[1]`` pixels of smoothing, ``c[0]`` pixels of amplitude)."""
    unit = _unit(image).astype(np.float32)
    centre, reach = np.float32(_SIDE // 2), _SIDE // 3
    corners = np.float32(
        [[centre + reach] * 2, [centre + reach, centre - reach], [centre - reach] * 2]
    )
    moved = corners + rng.uniform(-c[2], c[2], size=corners.shape).astype(np.float32)
    warp = cv2.getAffineTransform(corners, moved)
    unit = cv2.warpAffine(unit, warp, (_SIDE, _SIDE), borderMode=cv2.BORDER_REFLECT_101)
    dx, dy = (
        gaussian(rng.uniform(-1, 1, size=(_SIDE, _SIDE)), c[1], mode="reflect", truncate=3) * c[0]
        for _ in range(2)
    )
    rows, cols = np.meshgrid(np.arange(_SIDE), np.arange(_SIDE), indexing="ij")
    coordinates = [rows + dy, cols + dx]
    channels = [
        map_coordinates(unit[..., k], coordinates, order=1, mode="reflect") for k in range(3)
    ]
    return _pixels(np.stack(channels, axis=-1))


_S = _SIDE  # elastic_transform's constants are fractions of the image side
# name -> (function, its constant at severities 1..5): CIFAR-10-C's (make_cifar_c.py)
CORRUPTIONS: dict[str, tuple[Corruption, tuple]] = {
    "gaussian_noise": (gaussian_noise, (0.04, 0.06, 0.08, 0.09, 0.10)),
    "shot_noise": (shot_noise, (500, 250, 100, 75, 50)),
    "impulse_noise": (impulse_noise, (0.01, 0.02, 0.03, 0.05, 0.07)),
    "defocus_blur": (defocus_blur, ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1))),
    "glass_blur": (
        glass_blur,
        ((0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)),
    ),
    "motion_blur": (motion_blur, ((6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5))),
    "zoom_blur": (zoom_blur, (1.06, 1.11, 1.16, 1.21, 1.26)),
    "snow": (
        snow,
        (
            (0.1, 0.2, 1, 0.6, 8, 3, 0.95),
            (0.1, 0.2, 1, 0.5, 10, 4, 0.9),
            (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
            (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85),
            (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8),
        ),
    ),
    "frost": (frost, ((1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45))),
    "fog": (fog, ((0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75))),
    "brightness": (brightness, (0.05, 0.1, 0.15, 0.2, 0.3)),
    "contrast": (contrast, (0.75, 0.5, 0.4, 0.3, 0.15)),
    "elastic_transform": (
        elastic_transform,
        (
            (0, 0, _S * 0.08),
            (_S * 0.05, _S * 0.2, _S * 0.07),
            (_S * 0.08, _S * 0.06, _S * 0.06),
            (_S * 0.1, _S * 0.04, _S * 0.05),
            (_S * 0.1, _S * 0.03, _S * 0.03),
        ),
    ),
    "pixelate": (pixelate, (0.95, 0.9, 0.85, 0.75, 0.65)),
    "jpeg_compression": (jpeg_compression, (80, 65, 58, 50, 40)),
    "speckle_noise": (speckle_noise, (0.06, 0.1, 0.12, 0.16, 0.2)),
    "gaussian_blur": (gaussian_blur, (0.4, 0.6, 0.7, 0.8, 1.0)),
    "spatter": (spatter, SEVERITIES),  # the library's severity (see above)
    "saturate": (saturate, ((0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2))),
}


def check_corruption(name: str) -> None:
    if name not in CORRUPTIONS:
        raise DpivonError(f"unknown corruption {name!r}; choose among {', '.join(CORRUPTIONS)}")


def check_severity(severity: int) -> None:
    if severity not in SEVERITIES:
        raise DpivonError(f"severity must be an integer from 1 to 5, got {severity}")


def image_seed(corruption: str, severity: int, key: int) -> np.random.SeedSequence:
    """The seed of one image's corruption: its name's position, the severity, the key."""
    return np.random.SeedSequence([list(CORRUPTIONS).index(corruption), severity, int(key)])


def corrupt_images(
    images: np.ndarray, keys: np.ndarray, corruption: str, severity: int
) -> np.ndarray:
    """``images`` (N, 32, 32, 3) uint8 corrupted, each from its own generator (``keys``:
    one integer per image, its index in the test set); uint8 by truncation, as CIFAR-10-C."""
    check_corruption(corruption)
    check_severity(severity)
    function, constants = CORRUPTIONS[corruption]
    constant = constants[severity - 1]
    out = np.empty_like(images)
    for i, (image, key) in enumerate(zip(images, keys, strict=True)):
        rng = np.random.default_rng(image_seed(corruption, severity, key))
        out[i] = np.uint8(function(image, constant, rng))
    return out


def _library_versions() -> str:
    names = ("imagecorruptions-imaug", "scikit-image", "opencv-python", "numpy", "pillow")
    return ",".join(f"{name}={metadata.version(name)}" for name in names)


def corrupted_cache_file(
    arrays: ImageArrays, keys: np.ndarray, corruption: str, severity: int, cache: Path
) -> Path:
    """Where a set is cached: named by the corruption and severity, keyed by a hash of the
    clean images, their keys and the versions that made it (a change makes a new set)."""
    digest = hashlib.sha256()
    for part in (arrays.images, arrays.labels, np.asarray(keys, dtype=np.int64)):
        digest.update(np.ascontiguousarray(part).tobytes())
    digest.update(f"{_CORRUPTION_VERSION}|{_library_versions()}".encode())
    return cache / f"cifar10c-{corruption}-s{severity}-{digest.hexdigest()[:16]}.npz"


def load_corrupted(
    arrays: ImageArrays,
    keys: np.ndarray,
    corruption: str,
    severity: int,
    *,
    cache_dir: str | Path | None = None,
) -> ImageArrays:
    """``arrays`` corrupted (labels kept), read from the cache when it holds the set, else
    made and cached there (``cache_dir``, else `$DPIVON_CACHE`, else ~/.cache/dpivon)."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = corrupted_cache_file(arrays, keys, corruption, severity, cache)
    cached = read_npz(path, ("images", "labels"))
    if cached is not None:
        return ImageArrays(cached["images"], cached["labels"], arrays.classes)
    images = corrupt_images(arrays.images, keys, corruption, severity)
    write_npz(path, {"images": images, "labels": arrays.labels})
    return ImageArrays(images, arrays.labels, arrays.classes)
