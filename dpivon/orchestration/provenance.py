"""What a sweep's or benchmark's parent run records of the code that ran it."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

# The packages whose versions decide what a run computes.
RECORDED_PACKAGES = ("torch", "opacus", "ray", "optuna", "mlflow", "pandas", "dp-accounting")


def provenance() -> dict[str, str]:
    """The git commit of the dpivon checkout ("unknown" outside one), the Python version and
    ``version.<package>`` of each of RECORDED_PACKAGES, as MLflow params."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    versions = {f"version.{p}": metadata.version(p) for p in RECORDED_PACKAGES}
    return {"git_commit": commit or "unknown", "python": platform.python_version(), **versions}
