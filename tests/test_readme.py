"""The README's examples marked ``<!-- runnable -->`` run as written, in order, in one
folder (a later block may use what an earlier one wrote), on synthetic data and the shared
CIFAR-10 copy: the README cannot drift from the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CIFAR10_TARBALL

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- runnable -->"
BLOCK = re.compile(rf"^{re.escape(MARKER)}\n```(bash|python)\n(.*?)^```$", re.M | re.S)
RUNNERS = {"bash": ["bash", "-euo", "pipefail", "-c"], "python": [sys.executable, "-c"]}


def runnable_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block right after the marker line."""
    blocks = BLOCK.findall(text)
    assert len(blocks) == text.count(MARKER), "a marker not followed by a bash/python block"
    return blocks


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a few CLI runs: about 2 min on an idle 2-core machine
def test_readme_examples_run(tmp_path):
    blocks = runnable_blocks((ROOT / "README.md").read_text())
    assert {language for language, _ in blocks} == {"bash", "python"}
    (tmp_path / ".venv").symlink_to(sys.prefix)  # the README's .venv/bin/... commands
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # README's store
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["DPIVON_DATA"] = str(CIFAR10_TARBALL)
    for number, (language, code) in enumerate(blocks, 1):
        ran = subprocess.run(
            [*RUNNERS[language], code], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert ran.returncode == 0, (
            f"README block {number} ({language}) failed:\n{code}\n{ran.stdout[-2000:]}"
            f"\n{ran.stderr[-3000:]}"
        )
        # e.g. "INFO mlflow.store.db.utils: Creating initial MLflow database tables..."
        assert " INFO mlflow" not in ran.stderr, ran.stderr


def test_marker_finds_blocks_and_only_after_it():
    text = f"intro\n```bash\nnot this\n```\n{MARKER}\n```python\nprint(1)\n```\n"
    assert runnable_blocks(text) == [("python", "print(1)\n")]
