"""What code a logged model runs, and the check that a model folder runs only that.

Loading an MLflow model runs code from its folder: the module its ``MLmodel`` names as
loader, the entry point (``mlflow_model.py``) and whatever it imports from ``code/``. A
model folder is only as trustworthy as whoever handed it over, so before MLflow imports
anything from one, dpivon compares those with the installed dpivon's own files, byte for
byte: a manifest or hash inside the folder could be forged along with the code it vouches
for. A folder that differs is refused in one line naming the first offending file, unless
the user passes ``--trust-model-code``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
import yaml
from mlflow.exceptions import MlflowException
from mlflow.pyfunc.loaders import code_model

from dpivon.errors import DpivonError, first_line
from dpivon.tracking.client import fluent_tracking_uri, resolve_tracking_uri

PACKAGE = Path(__file__).parents[1]  # dpivon itself: logged as the model's code
ENTRY_POINT = PACKAGE / "mlflow_model.py"
CODE_FOLDER = "code"  # the model folder's folder that MLflow puts first on sys.path
# Bytecode caches are no code dpivon logs, and one whose header matches its source's size
# and time (both copied with the folder) runs instead of that source: never trusted.
BYTECODE = "__pycache__"
TRUST_FLAG = "--trust-model-code"


def _expected_loader() -> dict[str, Any]:
    """The keys of the MLmodel's python_function flavor that decide which code runs, as
    ``mlflow.pyfunc.log_model`` writes them for dpivon's model from code. ``data`` is absent:
    MLflow would look for the entry point in that folder instead."""
    return {
        "loader_module": code_model.__name__,
        "code": CODE_FOLDER,
        "model_code_path": ENTRY_POINT.name,  # MLflow loads the folder's file of that name
        "data": None,
    }


def _differences(folder: Path) -> list[str]:
    """Every way the model folder's loader and code differ from what the installed dpivon
    logs, the loader first."""
    mlmodel = folder / "MLmodel"
    if not mlmodel.is_file():
        return ["no MLmodel: not a model folder"]
    try:
        pyfunc = yaml.safe_load(mlmodel.read_text())["flavors"]["python_function"]
    except (yaml.YAMLError, UnicodeDecodeError, TypeError, KeyError) as err:
        return [f"MLmodel is not a python_function model's: {first_line(err)}"]
    if not isinstance(pyfunc, dict):
        return ["MLmodel's python_function flavor is not a mapping"]
    found = []
    for key, expected in _expected_loader().items():
        value = pyfunc.get(key)
        if key == "model_code_path" and isinstance(value, str):
            value = Path(value).name  # the path it was logged from; MLflow uses the name only
        if value != expected:
            found.append(f"MLmodel's python_function {key} is {value!r}, not {expected!r}")
    entry = folder / ENTRY_POINT.name
    if not entry.is_file() or entry.read_bytes() != ENTRY_POINT.read_bytes():
        found.append(f"{entry.name} is not the installed dpivon's entry point")
    code = folder / CODE_FOLDER
    expected_code = _files(PACKAGE, Path(CODE_FOLDER, PACKAGE.name))
    held = _files(code, Path(CODE_FOLDER)) if code.is_dir() else {}
    for name in sorted(expected_code.keys() | held.keys()):
        if name not in held:
            found.append(f"{name} is missing (the installed dpivon has it)")
        elif name not in expected_code:
            found.append(f"{name} is not in the installed dpivon (an added file)")
        elif not held[name].is_file() or held[name].is_symlink():
            found.append(f"{name} is not a regular file")
        elif held[name].read_bytes() != expected_code[name].read_bytes():
            found.append(f"{name} differs from the installed dpivon's")
    return found


def _files(root: Path, prefix: Path) -> dict[str, Path]:
    """Every file and link under ``root`` but bytecode caches, by its path in a model folder
    (``prefix`` standing for ``root``)."""
    return {
        (prefix / path.relative_to(root)).as_posix(): path
        for path in root.rglob("*")
        if not path.is_dir() or path.is_symlink()
        if BYTECODE not in path.relative_to(root).parts
    }


def verify_model_folder(folder: Path, model_uri: str) -> None:
    """Refuse, in one line naming the first offending file, a model folder whose loader or
    code is not byte for byte what the installed dpivon logs."""
    found = _differences(folder)
    if not found:
        return
    more = f", and {len(found) - 1} more difference(s)" if len(found) > 1 else ""
    raise DpivonError(
        f"the model {model_uri} would run code the installed dpivon did not write: "
        f"{found[0]}{more}; it was logged by another dpivon or MLflow version, or changed "
        f"since. Pass {TRUST_FLAG} to load it only if you trust its maker"
    )


def _download_errors() -> tuple[type[Exception], ...]:
    """What fetching a model folder raises for an unreachable or refused store."""
    errors: tuple[type[Exception], ...] = (MlflowException, OSError)
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # no S3 client installed: no S3 store to fail
        return errors
    return (*errors, BotoCoreError, ClientError)


def _check_local_folder(path: Path, model_uri: str) -> None:
    """A local model is a folder of files and folders only: MLflow's error for a missing one
    is a page long, and copying a FIFO (or a link to one) would wait forever."""
    if not path.exists():
        raise DpivonError(
            f"the model {model_uri} does not exist: give runs:/RUN_ID/model, "
            "models:/NAME/VERSION or a model folder"
        )
    if not path.is_dir():
        raise DpivonError(f"cannot load the model {model_uri}: it is a file, not a folder")
    if not (path / "MLmodel").is_file():
        raise DpivonError(f"cannot load the model {model_uri}: no MLmodel, not a model folder")
    for entry in path.rglob("*"):
        if entry.is_symlink() or not (entry.is_file() or entry.is_dir()):
            raise DpivonError(
                f"cannot load the model {model_uri}: {entry.relative_to(path)} is neither a "
                "file nor a folder"
            )


@contextmanager
def verified_model_folder(
    model_uri: str, tracking_uri: str | None = None, trust_code: bool = False
) -> Iterator[Path]:
    """A private copy of the model (``runs:/RUN_ID/model``, ``models:/NAME/VERSION``, a
    folder, an ``s3://`` URI), checked by :func:`verify_model_folder` unless ``trust_code``;
    removed on exit. A copy even of a local folder: what was checked is what loads, and its
    bytecode caches can be dropped."""
    source = model_uri
    if ":/" not in model_uri:
        source = str(Path(model_uri).expanduser())
        _check_local_folder(Path(source), model_uri)
    with tempfile.TemporaryDirectory(prefix="dpivon-model-") as tmp:
        try:
            with fluent_tracking_uri(resolve_tracking_uri(tracking_uri)):
                folder = Path(mlflow.artifacts.download_artifacts(source, dst_path=tmp))
        except _download_errors() as err:
            hint = ""
            if type(err).__name__ == "NoCredentialsError":  # botocore's (optional: by name)
                hint = " (S3 credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or ~/.aws)"
            raise DpivonError(
                f"cannot load the model {model_uri}: {first_line(err)}{hint}"
            ) from None
        if not folder.is_dir():
            raise DpivonError(f"cannot load the model {model_uri}: it is a file, not a folder")
        for cache in list(folder.rglob(BYTECODE)):
            if cache.is_dir() and not cache.is_symlink():
                shutil.rmtree(cache)
            else:
                cache.unlink()
        if not trust_code:
            verify_model_folder(folder, model_uri)
        yield folder
