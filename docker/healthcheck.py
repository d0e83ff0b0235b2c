"""Health check of the dpivon images (their Docker HEALTHCHECK: dpivon-healthcheck).

Healthy (exit 0) when the dpivon package imports and, in a container started as a Ray node
(``ray start`` in PID 1's command line, directly, under docker-init or a shell), a raylet
runs in the container and the cluster's GCS answers ``ray health-check``; that reads the
address from RAY_ADDRESS (else the node's own record) and the token from RAY_AUTH_TOKEN or
RAY_AUTH_TOKEN_PATH when RAY_AUTH_MODE=token. Unhealthy: one line, exit 1.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

PROC = Path("/proc")
RAY_NODE = re.compile(r"(?:^|[\s/;&|])ray\s+start(?:\s|$)")


def command_line(pid: str = "1", proc: Path = PROC) -> str:
    try:
        raw = (proc / pid / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def is_ray_node(command: str) -> bool:
    return RAY_NODE.search(command) is not None


def raylet_running(proc: Path = PROC) -> bool:
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() == "raylet":
                return True
        except OSError:
            continue
    return False


def check(proc: Path = PROC) -> str | None:
    """None when healthy, else the reason."""
    try:
        import dpivon.cli  # noqa: F401
    except Exception as err:  # a broken install, whatever the exception
        return f"dpivon does not import: {type(err).__name__}: {err}"
    if not is_ray_node(command_line(proc=proc)):
        return None
    if not raylet_running(proc):
        return "this container runs `ray start` but no raylet"
    try:
        done = subprocess.run(
            [shutil.which("ray") or "ray", "health-check"],
            capture_output=True,
            text=True,
            timeout=25,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"ray health-check did not run: {err}"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return f"ray health-check failed: {lines[-1] if lines else done.returncode}"
    return None


def main() -> int:
    problem = check()
    if problem:
        print(f"unhealthy: {problem}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
