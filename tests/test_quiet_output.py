"""What a user sees when a sweep starts: no third-party warning they cannot act on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

START_LOCAL_RAY = """
import os, ray
from dpivon.orchestration.ray_cluster import init_ray
init_ray(None)
assert ray.is_initialized()
print("auth", os.environ.get("RAY_AUTH_MODE"))  # Ray sets it when it turns token auth on
ray.shutdown()
"""


@pytest.mark.parametrize("ray_address", [None, "local"])  # none given, or RAY_ADDRESS=local
def test_a_local_ray_starts_with_token_authentication_and_without_its_warning(
    tmp_path, ray_address
):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    env["HOME"] = str(tmp_path)  # Ray keeps its generated token under ~/.ray
    ran = subprocess.run(
        [sys.executable, "-c", START_LOCAL_RAY], env=env, capture_output=True, text=True,
        timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "auth token" in ran.stdout  # Ray's default, chosen explicitly
    assert "Token authentication" not in ran.stderr and "WARNING" not in ran.stderr, ran.stderr
