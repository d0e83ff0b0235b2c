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


CTRL_C_DURING_RAY_SHUTDOWN = """
import os, signal, ray
from dpivon.commands import end_ray
ray.init(include_dashboard=False, log_to_driver=False)
real_shutdown = ray.shutdown

def shutdown_under_ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)  # pressed while Ray shuts down
    real_shutdown()

ray.shutdown = shutdown_under_ctrl_c
print("exit code", end_ray(), "ray up", ray.is_initialized())
"""


def test_ctrl_c_while_ray_shuts_down_is_one_line_and_the_shutdown_finishes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(tmp_path)
    ran = subprocess.run(
        [sys.executable, "-c", CTRL_C_DURING_RAY_SHUTDOWN], env=env, capture_output=True,
        text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "exit code 130 ray up False" in ran.stdout
    said = [line for line in ran.stderr.splitlines() if "SIGINT" in line]
    assert said == ["SIGINT: waiting for Ray to shut down (again to end at once)"], ran.stderr
    assert "Traceback" not in ran.stderr
