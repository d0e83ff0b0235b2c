"""Static checks of the deployment files in docker/ (no container engine or cluster runs here).

The images, the compose file and the KubeRay manifests cannot be started in CI, so this
checks what can be checked without running them, against the package and its pins: every
YAML parses; the compose services exist, publish ports on 127.0.0.1 unless configured, take
their credentials from docker/.env and never from the files; images are pinned; the
Dockerfiles install pyproject.toml's pins; every `dpivon` command, option and pipeline path
they name exists; every environment variable they set is read by dpivon, Ray, MLflow or the
service it is given to; Ray token authentication is on everywhere; the KubeRay manifests
run the CUDA image on a GPU worker group with shared storage. Each checker is also fed bad
input (test_checkers_reject_bad_input), so none of them passes by construction.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import typer
import yaml

from dpivon.cli import app

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
KUBERAY = DOCKER / "kuberay"
COMPOSE = DOCKER / "compose.yaml"
IMAGE_ROOT = "/opt/dpivon"  # the images' WORKDIR: pipelines/ and search_spaces/ are there
EXPECTED_SERVICES = {"postgres", "minio", "mlflow", "ray-head", "ray-worker", "ray-worker-gpu"}
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|CREDENTIAL", re.IGNORECASE)
# Variables the dpivon package itself must read (the driver relies on them).
PACKAGE_VARIABLES = re.compile(r"^(DPIVON_\w+|MLFLOW_TRACKING_URI|RAY_ADDRESS)$")
# Variables read by programs whose source is not installed here, with who reads them.
EXTERNAL_VARIABLES = {
    "POSTGRES_USER": "postgres image",
    "POSTGRES_DB": "postgres image",
    "POSTGRES_PASSWORD": "postgres image",
    "MINIO_ROOT_USER": "MinIO",
    "MINIO_ROOT_PASSWORD": "MinIO",
    "PGPASSWORD": "libpq (psycopg2)",
    "AWS_ACCESS_KEY_ID": "boto3",
    "AWS_SECRET_ACCESS_KEY": "boto3",
    "AWS_DEFAULT_REGION": "boto3",
    "AWS_ENDPOINT_URL": "pyarrow's S3 filesystem (the AWS SDK) and boto3",
    "PATH": "the shell",
    "VIRTUAL_ENV": "uv",
    "PYTHONUNBUFFERED": "CPython",
    "PIP_NO_CACHE_DIR": "pip",
    "PIP_DISABLE_PIP_VERSION_CHECK": "pip",
    "UV_NO_CACHE": "uv",
    "UV_LINK_MODE": "uv",
    "UV_PYTHON_INSTALL_DIR": "uv",
    "UV_PYTHON_PREFERENCE": "uv",
}


# ---------------------------------------------------------------------------------------
# Reading the files


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@cache
def pyproject_pins() -> dict[str, str]:
    """name -> version of every `name==version` in pyproject.toml (extras included)."""
    project = pyproject()["project"]
    requirements = list(project["dependencies"])
    for group in project.get("optional-dependencies", {}).values():
        requirements += group
    pins = {}
    for requirement in requirements:
        match = re.fullmatch(
            r"\s*([A-Za-z0-9][\w.-]*)(?:\[[^\]]*\])?\s*==\s*([^\s;,]+)\s*", requirement
        )
        if match:
            pins[_norm(match[1])] = match[2]
    return pins


def python_minor() -> str:
    """'3.11' from requires-python '>=3.11,<3.12'."""
    match = re.search(r">=\s*(\d+\.\d+)", pyproject()["project"]["requires-python"])
    assert match, "pyproject.toml: requires-python has no lower bound"
    return match[1]


def yaml_files() -> list[Path]:
    return sorted(p for p in DOCKER.rglob("*") if p.suffix in (".yaml", ".yml"))


def load_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@cache
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def dockerfiles() -> list[Path]:
    return sorted(
        p
        for p in DOCKER.iterdir()
        if (p.name.startswith("Dockerfile") or p.name.endswith(".Dockerfile"))
        and not p.name.endswith(".dockerignore")
    )


def instructions(text: str) -> list[tuple[str, str]]:
    """A Dockerfile as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    out, buffer = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        word, _, rest = (buffer + line).partition(" ")
        out.append((word.upper(), rest.strip()))
        buffer = ""
    assert not buffer, "a Dockerfile ends in a line continuation"
    return out


def stages(text: str) -> list[dict[str, Any]]:
    """The build stages: base image, alias and instructions of each."""
    result: list[dict[str, Any]] = []
    for word, rest in instructions(text):
        if word == "FROM":
            parts = [p for p in rest.split() if not p.startswith("--platform")]
            alias = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            result.append({"image": parts[0], "alias": alias, "body": []})
        else:
            assert result, f"{word} before the first FROM"
            result[-1]["body"].append((word, rest))
    return result


def build_tag(path: Path) -> str:
    """The tag that the Dockerfile's header comment builds it with (`docker build ... -t TAG`)."""
    match = re.search(r"^#\s+docker build\b.*?\s-t\s+(\S+)", path.read_text(), re.MULTILINE)
    assert match, f"{path.name}: no `docker build ... -t TAG` line in its header"
    return match[1]


PIP_VALUE_OPTIONS = {
    "-i", "--index-url", "--extra-index-url", "-r", "--requirement", "-c", "--constraint",
    "-f", "--find-links", "--python", "-t", "--target", "--prefix", "--root", "-p",
}  # fmt: skip


def pip_installs(run: str) -> list[dict[str, Any]]:
    """Each `pip install` / `uv pip install` of a RUN: its requirements, files and options."""
    found = []
    for segment in re.split(r"&&|\|\||;", run):
        try:
            words = shlex.split(segment)
        except ValueError:
            continue
        for i in range(len(words) - 1):
            if not (re.fullmatch(r"(.*/)?pip3?", words[i]) and words[i + 1] == "install"):
                continue
            tool = "uv" if i > 0 and words[i - 1].endswith("uv") else "pip"
            requirements, files, options = [], [], []
            args = iter(words[i + 2 :])
            for arg in args:
                if arg.startswith("-"):
                    options.append(arg)
                    if arg in PIP_VALUE_OPTIONS:
                        value = next(args, "")
                        if arg in ("-r", "--requirement"):
                            files.append(value)
                else:
                    requirements.append(arg)
            found.append({"tool": tool, "requirements": requirements, "files": files,
                          "options": options})  # fmt: skip
    return found


def pin_problems(requirements: list[str]) -> list[str]:
    """Requirements that are not `name==version`, or whose pin differs from pyproject.toml's."""
    problems = []
    for requirement in requirements:
        if requirement in (".", "./") or requirement.startswith(("/", "./")):
            continue  # the local package: its dependencies are pyproject.toml's
        match = re.fullmatch(r"([A-Za-z0-9][\w.-]*)(?:\[[^\]]*\])?==([\w.+!-]+)", requirement)
        if not match:
            problems.append(f"{requirement!r} is not pinned with ==")
            continue
        expected = pyproject_pins().get(_norm(match[1]))
        if expected is not None and match[2] != expected:
            problems.append(f"{requirement!r}: pyproject.toml pins {match[1]}=={expected}")
    return problems


def interpolate(value: str) -> str:
    """A compose value with its ${VAR:-default} defaults, and <VAR> for required/unset ones."""

    def one(match: re.Match) -> str:
        name, op, arg = match[1], match[2], match[3]
        return arg if op == ":-" else f"<{name}>"

    return re.sub(r"\$\{(\w+)(?:(:-|:\?|-|\?)([^}]*))?\}", one, str(value))


def split_outside(text: str, sep: str) -> list[str]:
    """Split on `sep` outside ${...} and [...] (so ${BIND:-127.0.0.1} and [::1] stay whole)."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        if char == sep and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def port_binding_problem(port: Any) -> str | None:
    """None when a published port binds to 127.0.0.1 by default (or a variable for it)."""
    if isinstance(port, dict):
        host = str(port.get("host_ip", ""))
        if "published" not in port:
            return None  # nothing published on the host
    else:
        parts = split_outside(str(port).split("/")[0], ":")
        host = parts[0] if len(parts) == 3 else ""
    if re.fullmatch(r"127\.0\.0\.1|\$\{\w+:-127\.0\.0\.1\}", host):
        return None
    return f"{port!r} binds to {host or 'every interface'}; use ${{DPIVON_BIND:-127.0.0.1}}:..."


def image_problem(ref: str) -> str | None:
    """None when an image reference is pinned: a digest or a versioned tag, never latest."""
    if re.search(r"@sha256:[0-9a-f]{64}$", ref):
        return None
    last = ref.split("/")[-1]
    if ":" not in last:
        return f"{ref}: no tag"
    tag = last.split(":", 1)[1]
    if tag == "latest" or not re.search(r"\d+\.\d+|\d{4}-\d{2}-\d{2}", tag):
        return f"{ref}: tag {tag!r} is not a pinned version"
    return None


def secret_value_problem(name: str, value: Any) -> str | None:
    """A secret-looking compose variable must come from docker/.env: ${VAR:?message}."""
    if not SECRET_NAME.search(name) or name.endswith(("_PATH", "_FILE")):
        return None
    if isinstance(value, str) and re.fullmatch(r"\$\{\w+:\?[^}]*\}", value):
        return None
    return f"{name}={value!r}: a credential must be ${{VAR:?...}} from docker/.env"


# ---------------------------------------------------------------------------------------
# dpivon commands named in the files


@cache
def cli_commands() -> dict[str, set[str]]:
    """Each registered dpivon subcommand and its option names."""
    group = typer.main.get_command(app)
    return {
        name: {
            opt
            for param in command.params
            for opt in [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]
            if opt.startswith("-")
        }
        | {"--help"}
        for name, command in group.commands.items()
    }


def repo_path(path: str) -> Path:
    return REPO / path.removeprefix(IMAGE_ROOT + "/").removeprefix("./")


def command_problems(text: str) -> list[str]:
    """Problems of every `dpivon SUBCOMMAND ...` in a command line: the subcommand, its options
    and the pipeline files it names must exist."""
    problems = []
    for match in re.finditer(r"(?:^|[\s/;&|`(])dpivon\s+([a-z][\w-]*)([^;&|`)\n]*)", text):
        sub, rest = match[1], match[2]
        if sub not in cli_commands():
            problems.append(f"`dpivon {sub}`: no such subcommand ({sorted(cli_commands())})")
            continue
        for word in (w.strip("'\"") for w in rest.split()):
            option = word.split("=")[0]
            if option.startswith("--") and option not in cli_commands()[sub]:
                problems.append(f"`dpivon {sub} {option}`: no such option")
            named = word.endswith((".yaml", ".yml")) and word.startswith(("pipelines/", IMAGE_ROOT))
            if named and not repo_path(word).is_file():
                problems.append(f"`dpivon {sub} {word}`: {repo_path(word)} does not exist")
    return problems


def command_text(value: Any) -> str:
    if isinstance(value, list):
        return shlex.join(str(v) for v in value)
    return str(value or "")


def comment_commands(path: Path) -> str:
    """The indented command lines of a file's comments (`#   dpivon sweep ...`)."""
    lines = re.findall(r"^\s*#\s{2,}(\S.*)$", path.read_text(), re.MULTILINE)
    return "\n".join(lines)


def readme_cluster_section() -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(
        r"^## [^\n]*[Cc]luster[^\n]*\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL
    )
    assert match, "README.md has no section on clusters"
    return match[1]


# ---------------------------------------------------------------------------------------
# Environment variables: who reads them


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # finds the package without importing it
    assert spec and spec.submodule_search_locations, f"{name} is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


@cache
def source_text(kind: str) -> str:
    if kind == "package":
        files = list((REPO / "dpivon").rglob("*.py"))
    elif kind == "docker":
        files = list(DOCKER.glob("*.py"))
    elif kind == "ray":
        ray = _package_dir("ray")
        files = [
            *ray.glob("*.py"),
            *(ray / "_private").rglob("*.py"),
            *(ray / "scripts").glob("*.py"),
        ]
    elif kind == "mlflow":
        mlflow = _package_dir("mlflow")
        files = [mlflow / "environment_variables.py", *(mlflow / "cli").glob("*.py"),
                 mlflow / "utils" / "cli_args.py"]  # fmt: skip
    else:
        raise ValueError(kind)
    return "\n".join(f.read_text(errors="replace") for f in files)


def reads_variable(kind: str, name: str) -> bool:
    return re.search(rf"""["']{re.escape(name)}["']""", source_text(kind)) is not None


def variable_problem(name: str) -> str | None:
    if PACKAGE_VARIABLES.match(name):
        return None if reads_variable("package", name) else f"{name}: dpivon never reads it"
    if name in EXTERNAL_VARIABLES or any(reads_variable(k, name) for k in ("package", "docker")):
        return None
    if name.startswith("RAY_") and reads_variable("ray", name):
        return None
    if name.startswith("MLFLOW_") and reads_variable("mlflow", name):
        return None
    return f"{name}: read by neither dpivon, Ray, MLflow nor a known service"


def compose_variables() -> dict[str, dict[str, Any]]:
    """service -> its container environment (the mapping form)."""
    result = {}
    for name, service in services().items():
        env = service.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
        result[name] = env
    return result


def dockerfile_variables(path: Path) -> set[str]:
    names = set()
    for word, rest in instructions(path.read_text()):
        if word == "ENV":
            names |= set(re.findall(r"(?:^|\s)(\w+)=", rest))
    return names


# ---------------------------------------------------------------------------------------
# KubeRay


@cache
def kube_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        docs += [{**doc, "_file": path.name} for doc in load_all(path)]
    return docs


def ray_cluster_specs() -> list[tuple[str, dict[str, Any]]]:
    specs = []
    for doc in kube_docs():
        if doc.get("kind") == "RayCluster":
            specs.append((f"{doc['_file']} RayCluster", doc["spec"]))
        elif doc.get("kind") == "RayJob":
            specs.append((f"{doc['_file']} RayJob", doc["spec"]["rayClusterSpec"]))
    return specs


def pod_specs(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    pods = [("head", spec["headGroupSpec"]["template"]["spec"])]
    pods += [(g["groupName"], g["template"]["spec"]) for g in spec.get("workerGroupSpecs", [])]
    return pods


def gpu_limit(pod: dict[str, Any]) -> float:
    limits = pod["containers"][0].get("resources", {}).get("limits", {})
    return float(limits.get("nvidia.com/gpu", 0))


def load_pipeline_yaml(path: Path) -> dict[str, Any]:
    """The pipeline's fields (the YAML only: dpivon.search.pipeline imports torch, slow)."""
    pipeline = yaml.safe_load(path.read_text())
    for optimizer in pipeline["optimizers"]:
        space = optimizer["space"]
        assert (path.parent / space).is_file() or (REPO / space).is_file(), (
            f"{path.name}: search space {space} does not exist"
        )
    return pipeline


def sweep_pipeline(entrypoint: str) -> Path:
    match = re.search(r"dpivon\s+sweep\s+(\S+)", entrypoint)
    assert match, f"{entrypoint!r} runs no `dpivon sweep`"
    return repo_path(match[1])


# =======================================================================================
# Tests


def test_yaml_files_parse() -> None:
    files = yaml_files()
    names = {p.relative_to(DOCKER).as_posix() for p in files}
    assert {"compose.yaml", "kuberay/raycluster.yaml", "kuberay/rayjob.yaml"} <= names, names
    for path in files:
        docs = load_all(path)
        assert docs and all(isinstance(d, dict) for d in docs), f"{path}: no YAML mapping"


def test_compose_services_and_scalable_workers() -> None:
    assert set(services()) >= EXPECTED_SERVICES, sorted(services())
    worker = services()["ray-worker"]
    replicas = worker.get("deploy", {}).get("replicas")
    assert isinstance(replicas, int) and replicas >= 1, "ray-worker: deploy.replicas >= 1"
    for key in ("container_name", "ports", "hostname"):
        assert key not in worker, f"ray-worker: {key} stops `--scale ray-worker=N`"
    head_cmd = command_text(services()["ray-head"].get("entrypoint"))
    head_port = re.search(r"--port[= ](\d+)", head_cmd)
    assert "--head" in head_cmd and head_port, head_cmd
    for name in ("ray-worker", "ray-worker-gpu"):
        cmd = command_text(services()[name].get("entrypoint"))
        assert f"--address=ray-head:{head_port[1]}" in cmd, f"{name} does not join the head: {cmd}"
        assert services()[name]["depends_on"]["ray-head"]["condition"] == "service_healthy"
    gpu = services()["ray-worker-gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices), "ray-worker-gpu has no GPU"


def test_published_ports_bind_loopback_unless_configured() -> None:
    published = 0
    for name, service in services().items():
        for port in service.get("ports", []):
            published += 1
            problem = port_binding_problem(port)
            assert problem is None, f"{name}: {problem}"
    assert published >= 3, "expected the MLflow, Ray dashboard and Ray client ports published"
    assert "ports" not in services()["postgres"], "PostgreSQL must not be published"


def test_no_credentials_in_the_files() -> None:
    for service, env in compose_variables().items():
        for name, value in env.items():
            problem = secret_value_problem(name, value)
            assert problem is None, f"compose {service}: {problem}"
    for doc in kube_docs():
        assert doc.get("kind") != "Secret", f"{doc['_file']}: create Secrets out of band"
    for where, spec in ray_cluster_specs():
        for _, pod in pod_specs(spec):
            for var in pod["containers"][0].get("env", []):
                if SECRET_NAME.search(var["name"]):
                    assert "value" not in var, f"{where}: {var['name']} has a literal value"
    uri_with_password = re.compile(r"[a-z][\w+.-]*://[^/\s:@'\"]+:[^/\s@'\"]+@")
    defaults = re.compile(
        r"(?i:minioadmin|changeme|hunter2)|[A-Z_]*(PASSWORD|TOKEN|SECRET)[A-Z_]*\s*[:=]\s*\w"
    )
    for path in DOCKER.rglob("*"):
        if not path.is_file() or path.name == ".env":
            continue  # docker/.env is the user's, ignored by git
        text = path.read_text()
        assert not uri_with_password.search(text), f"{path}: a URI with a password"
        for line in text.splitlines():
            if path.suffix in (".yaml", ".yml") and defaults.search(line) and "${" not in line:
                pytest.fail(f"{path}: a literal credential? {line.strip()}")
    example = (DOCKER / ".env.example").read_text()
    for name, value in re.findall(r"^(\w+)=(.*)$", example, re.MULTILINE):
        if SECRET_NAME.search(name):
            assert not value.strip(), f".env.example: {name} must be empty"
    assert ".env" in (DOCKER / ".gitignore").read_text().split(), "docker/.gitignore: .env"


def test_required_settings_are_generated_and_documented(tmp_path: Path) -> None:
    text = COMPOSE.read_text()
    required = set(re.findall(r"\$\{(\w+):\?", text))
    used = set(re.findall(r"\$\{(\w+)", text))
    assert {"POSTGRES_PASSWORD", "RAY_AUTH_TOKEN", "MINIO_ROOT_PASSWORD"} <= required, required
    script = tmp_path / "make-env.sh"
    script.write_text((DOCKER / "make-env.sh").read_text())
    subprocess.run(["sh", str(script)], check=True, capture_output=True, timeout=20)
    generated = dict(re.findall(r"^(\w+)=(.+)$", (tmp_path / ".env").read_text(), re.MULTILINE))
    assert required <= set(generated), f"make-env.sh does not write {required - set(generated)}"
    assert all(len(generated[n]) >= 32 for n in required if SECRET_NAME.search(n)), generated.keys()
    assert (tmp_path / ".env").stat().st_mode & 0o077 == 0, "docker/.env must be private (600)"
    documented = set(re.findall(r"^#?\s*(\w+)=", (DOCKER / ".env.example").read_text(), re.M))
    assert used <= documented, f".env.example does not document {used - documented}"


def test_images_pinned() -> None:
    refs = [(f"compose {n}", s["image"]) for n, s in services().items() if "image" in s]
    for path in dockerfiles():
        aliases = set()
        for stage in stages(path.read_text()):
            if stage["image"] not in aliases:
                refs.append((path.name, stage["image"]))
            if stage["alias"]:
                aliases.add(stage["alias"])
    for _, spec in ray_cluster_specs():
        refs += [(f"kuberay {g}", pod["containers"][0]["image"]) for g, pod in pod_specs(spec)]
    assert len(refs) >= 10, refs
    for where, ref in refs:
        problem = image_problem(ref)
        assert problem is None, f"{where}: {problem}"


def test_every_dockerfile_is_built_by_compose_under_its_tag() -> None:
    built = {}
    for name, service in services().items():
        if "build" in service:
            build = service["build"]
            dockerfile = COMPOSE.parent / build["context"] / build.get("dockerfile", "Dockerfile")
            built[dockerfile.resolve()] = (
                name,
                service["image"],
                COMPOSE.parent / build["context"],
            )
    for path in dockerfiles():
        assert path.resolve() in built, f"compose.yaml builds no image from {path.name}"
        service, image, _ = built[path.resolve()]
        assert image == build_tag(path), f"compose {service}: image {image} != {build_tag(path)}"
    version = pyproject()["project"]["version"]
    assert build_tag(DOCKER / "Dockerfile") == f"dpivon:{version}-cpu"
    assert build_tag(DOCKER / "Dockerfile.cuda") == f"dpivon:{version}-cuda"
    assert build_tag(DOCKER / "mlflow.Dockerfile").endswith(":" + pyproject_pins()["mlflow"])


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda", "mlflow.Dockerfile"])
def test_dockerfile_pins_user_healthcheck(name: str) -> None:
    path = DOCKER / name
    all_stages = stages(path.read_text())
    final = all_stages[-1]
    installs = []
    for stage in all_stages:
        env = " ".join(rest for word, rest in stage["body"] if word == "ENV")
        for word, rest in stage["body"]:
            if word != "RUN":
                continue
            for install in pip_installs(rest):
                installs.append(install)
                assert pin_problems(install["requirements"]) == [], (name, rest)
                no_cache = (
                    "--no-cache-dir" in install["options"] or "PIP_NO_CACHE_DIR=1" in env
                    if install["tool"] == "pip"
                    else "--no-cache" in install["options"] or "UV_NO_CACHE=1" in env
                )
                assert no_cache, f"{name}: `{rest}` keeps a download cache in the layer"
                for file in install["files"]:
                    assert "tomllib" in rest and "['project']['dependencies']" in rest, (
                        f"{name}: requirements file {file} is not made from pyproject.toml"
                    )
    assert installs, f"{name}: installs nothing"
    users = [rest for word, rest in final["body"] if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{name}: runs as root"
    healthchecks = [rest for word, rest in final["body"] if word == "HEALTHCHECK"]
    assert healthchecks and "CMD" in healthchecks[-1], f"{name}: no HEALTHCHECK"
    minor = python_minor()
    for stage in all_stages:
        image = stage["image"]
        if image.startswith("python:"):
            assert image.startswith(f"python:{minor}."), f"{name}: {image} is not Python {minor}"


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dpivon_images(name: str) -> None:
    path = DOCKER / name
    text = path.read_text()
    all_stages = stages(text)
    final = all_stages[-1]
    assert len(all_stages) >= 2, f"{name}: build in a stage of its own (small final image)"
    final_runs = " ".join(rest for word, rest in final["body"] if word == "RUN")
    assert not pip_installs(final_runs), f"{name}: the final stage installs packages"
    entrypoints = [rest for word, rest in final["body"] if word == "ENTRYPOINT"]
    assert entrypoints and yaml.safe_load(entrypoints[-1]) == ["dpivon"], f"{name}: ENTRYPOINT"
    requirements = []
    for stage in all_stages:
        for word, rest in stage["body"]:
            if word == "RUN":
                for install in pip_installs(rest):
                    requirements += install["requirements"]
    explicit = {_norm(r.split("==")[0].split("[")[0]) for r in requirements if "==" in r}
    assert {"torch", "torchvision"} <= explicit, f"{name}: torch/torchvision not pinned"
    assert "." in requirements, f"{name}: does not install the dpivon package"
    for word, rest in final["body"]:
        if word == "COPY" and not rest.startswith("--from"):
            source = rest.split()[0]
            assert (REPO / source).exists(), f"{name}: COPY {source}: not in the repository"
    ignore = (DOCKER / f"{name}.dockerignore").read_text().split("\n")
    patterns = [p.strip() for p in ignore if p.strip() and not p.startswith("#")]
    assert patterns[0] == "*", f"{name}.dockerignore: start from `*` (an allow-list)"
    allowed = [p[1:] for p in patterns if p.startswith("!")]
    for stage in all_stages:
        for word, rest in stage["body"]:
            if word == "COPY" and not rest.startswith("--from"):
                for source in rest.split()[:-1]:
                    assert any(
                        source.rstrip("/") == a or source.startswith(a + "/") for a in allowed
                    ), f"{name}.dockerignore leaves out {source}, which the build copies"
    assert not {".venv", ".git", "docker/.env", ".env"} & set(allowed)
    if name == "Dockerfile.cuda":
        assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", final["image"])
        assert re.search(rf"uv python install {re.escape(python_minor())}\.\d+", text)
        assert "COPY --from=build /opt/python /opt/python" in text
        cuda = re.search(r"nvidia/cuda:(\d+)\.(\d+)", final["image"])
        assert f"whl/cu{cuda[1]}{cuda[2]}" in text, "torch's CUDA build != the base image's CUDA"
    else:
        assert final["image"].startswith(f"python:{python_minor()}.")
        assert "whl/cpu" in text, "the CPU image should install torch's CPU wheels"


def test_ray_token_authentication_everywhere() -> None:
    ray_nodes = 0
    for name, service in services().items():
        cmd = command_text(service.get("entrypoint")) + " " + command_text(service.get("command"))
        if not re.search(r"\bray start\b", cmd):
            continue
        ray_nodes += 1
        env = compose_variables()[name]
        assert env.get("RAY_AUTH_MODE") == "token", f"{name}: RAY_AUTH_MODE is not token"
        token = env.get("RAY_AUTH_TOKEN") or env.get("RAY_AUTH_TOKEN_PATH")
        assert token and re.fullmatch(r"\$\{RAY_AUTH_TOKEN\w*:\?[^}]*\}", token), f"{name}: token"
        flags = re.findall(r"(--[\w-]+)", cmd)
        scripts = source_text("ray")
        for flag in flags:
            assert f'"{flag}"' in scripts, f"{name}: `ray start {flag}` is not an option of Ray"
    assert ray_nodes == 3, "ray-head, ray-worker and ray-worker-gpu start Ray"
    for where, spec in ray_cluster_specs():
        assert spec.get("authOptions", {}).get("mode") == "token", f"{where}: token auth off"
        assert spec["rayVersion"] == pyproject_pins()["ray"], f"{where}: rayVersion"


def test_mlflow_server_configuration() -> None:
    mlflow = services()["mlflow"]
    args = [interpolate(a) for a in mlflow["command"]]
    options = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
    cli = source_text("mlflow")
    for option in options:
        assert f'"{option}"' in cli, f"mlflow server has no option {option}"
    backend = options["--backend-store-uri"]
    assert re.fullmatch(r"postgresql\+psycopg2://\w+@postgres:5432/\w+", backend), backend
    artifacts = options.get("--artifacts-destination") or options.get("--default-artifact-root")
    assert artifacts and artifacts.startswith("s3://"), "MLflow artifacts must go to S3"
    allowed = options["--allowed-hosts"].split(",")
    assert "*" not in allowed, "--allowed-hosts must not allow every Host"
    port = options["--port"]
    tracking = compose_variables()["ray-head"]["MLFLOW_TRACKING_URI"]
    assert tracking == f"http://mlflow:{port}", tracking
    assert f"mlflow:{port}" in allowed, "the driver's Host header (mlflow:PORT) is refused"
    assert any(p.endswith(f":{port}") for p in map(str, mlflow["ports"])), mlflow["ports"]
    env = compose_variables()["mlflow"]
    assert env["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert env["PGPASSWORD"] == compose_variables()["postgres"]["POSTGRES_PASSWORD"]
    assert env["AWS_SECRET_ACCESS_KEY"] == compose_variables()["minio"]["MINIO_ROOT_PASSWORD"]
    entry = _module(DOCKER / "mlflow_entrypoint.py")
    assert entry.artifact_bucket(args) == artifacts.removeprefix("s3://").split("/")[0]
    assert entry.artifact_bucket(["--artifacts-destination", "/mnt/artifacts"]) is None


def test_ray_nodes_reach_the_s3_service() -> None:
    """A sweep may keep its state and checkpoints in MinIO (storage_path s3://..., as
    tests/test_topology.py runs it): every Ray node has its endpoint and credentials."""
    minio = compose_variables()["minio"]
    for name in ("ray-head", "ray-worker", "ray-worker-gpu"):
        env = compose_variables()[name]
        assert env.get("AWS_ENDPOINT_URL") == "http://minio:9000", f"{name}: S3 endpoint"
        assert env.get("AWS_ACCESS_KEY_ID") == minio["MINIO_ROOT_USER"], name
        assert env.get("AWS_SECRET_ACCESS_KEY") == minio["MINIO_ROOT_PASSWORD"], name


def test_environment_variables_are_read() -> None:
    names: dict[str, str] = {}
    for service, env in compose_variables().items():
        names |= {n: f"compose {service}" for n in env}
    for path in dockerfiles():
        names |= {n: path.name for n in dockerfile_variables(path)}
    for where, spec in ray_cluster_specs():
        for _, pod in pod_specs(spec):
            names |= {v["name"]: where for v in pod["containers"][0].get("env", [])}
    assert {"MLFLOW_TRACKING_URI", "RAY_ADDRESS", "DPIVON_DATA", "RAY_AUTH_MODE"} <= set(names)
    for name, where in sorted(names.items()):
        problem = variable_problem(name)
        assert problem is None, f"{where}: {problem}"


def test_commands_name_existing_subcommands_options_and_pipelines() -> None:
    texts = {}
    for name, service in services().items():
        texts[f"compose {name}"] = (
            command_text(service.get("entrypoint")) + "\n" + command_text(service.get("command"))
        )
    for doc in kube_docs():
        if doc.get("kind") == "RayJob":
            texts[f"{doc['_file']} entrypoint"] = doc["spec"]["entrypoint"]
    for path in [*DOCKER.glob("*"), *KUBERAY.glob("*")]:
        if path.is_file() and path.name != ".env":
            texts[f"{path.name} comments"] = comment_commands(path)
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", readme_cluster_section(), re.DOTALL)
    texts["README cluster section"] = "\n".join(blocks)
    invocations = sum(len(re.findall(r"dpivon\s+sweep", t)) for t in texts.values())
    assert invocations >= 5, texts
    for where, text in texts.items():
        assert command_problems(text) == [], where


def test_kuberay_manifests() -> None:
    kinds = {doc.get("kind") for doc in kube_docs()}
    assert {"RayCluster", "RayJob", "PersistentVolumeClaim"} <= kinds, kinds
    for doc in kube_docs():
        if doc["kind"] in ("RayCluster", "RayJob"):
            assert doc["apiVersion"] == "ray.io/v1", doc["_file"]
    claims = {
        doc["metadata"]["name"]: doc
        for doc in kube_docs()
        if doc["kind"] == "PersistentVolumeClaim"
    }
    cuda_tag = build_tag(DOCKER / "Dockerfile.cuda")
    uid = re.search(r"useradd\b.*--uid (\d+)", (DOCKER / "Dockerfile.cuda").read_text())[1]
    specs = ray_cluster_specs()
    assert len(specs) == 2
    assert specs[0][1] == specs[1][1], "RayCluster and RayJob clusters differ"
    for where, spec in specs:
        gpu_groups = [g for g, pod in pod_specs(spec)[1:] if gpu_limit(pod) >= 1]
        assert gpu_groups, f"{where}: no worker group with nvidia.com/gpu limits"
        for group, pod in pod_specs(spec):
            container = pod["containers"][0]
            assert container["image"].split("/")[-1] == cuda_tag, f"{where} {group}: image"
            security = pod.get("securityContext", {})
            assert security.get("runAsNonRoot") is True, f"{where} {group}: runAsNonRoot"
            assert str(security.get("runAsUser")) == uid, f"{where} {group}: uid != image's"
            mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
            shared = [v for v in pod.get("volumes", []) if "persistentVolumeClaim" in v]
            assert shared, f"{where} {group}: no shared volume"
            for volume in shared:
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert claim in claims, f"{where}: PVC {claim} is not defined in docker/kuberay"
                assert "ReadWriteMany" in claims[claim]["spec"]["accessModes"]
                assert volume["name"] in mounts, f"{where} {group}: {claim} is not mounted"
        head = pod_specs(spec)[0][1]["containers"][0]
        env = {v["name"]: v.get("value") for v in head.get("env", [])}
        assert re.fullmatch(r"https?://[\w.-]+(:\d+)?/?", env.get("MLFLOW_TRACKING_URI", "")), env
        assert pod_specs(spec)[0][1]["containers"][0]["name"] == "ray-head"
        head_mounts = [m["mountPath"] for m in head["volumeMounts"]]
        assert any(env["DPIVON_DATA"].startswith(m + "/") for m in head_mounts), "DPIVON_DATA"
    job = next(doc for doc in kube_docs() if doc["kind"] == "RayJob")
    entrypoint = job["spec"]["entrypoint"]
    assert re.search(r"dpivon\s+sweep\s+\S+\.yaml\s+.*--address\s+auto", entrypoint), entrypoint
    assert command_problems(entrypoint) == []
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    assert int(job["spec"]["activeDeadlineSeconds"]) > 0, "the job needs a deadline"
    pipeline = load_pipeline_yaml(sweep_pipeline(entrypoint))
    spec = job["spec"]["rayClusterSpec"]
    mounts = [m["mountPath"] for m in pod_specs(spec)[1][1]["containers"][0]["volumeMounts"]]
    storage = str(pipeline["storage_path"])
    assert storage.startswith(("s3://", "gs://")) or any(
        storage.startswith(m + "/") for m in mounts
    ), f"the pipeline's storage_path {storage} is not on storage every node shares"
    resources = pipeline.get("resources", {})
    worker = pod_specs(spec)[1][1]["containers"][0]["resources"]["limits"]
    assert float(resources.get("gpu", 0)) <= gpu_limit(pod_specs(spec)[1][1])
    assert float(resources.get("cpu", 1)) <= float(worker["cpu"]), "a trial fits no worker"


def test_compose_runs_the_documented_pipeline() -> None:
    """The compose file's example sweep fits its CPU workers and shared volume."""
    head = services()["ray-head"]
    match = re.search(r"dpivon sweep (\S+\.yaml)", COMPOSE.read_text())
    assert match, "compose.yaml's header shows no sweep"
    pipeline = load_pipeline_yaml(repo_path(match[1]))
    workdir = head["working_dir"]
    volumes = [
        str(v).split(":")[1] for v in head["volumes"] if not str(v).startswith(("/", "$", "."))
    ]
    storage = str(pipeline["storage_path"])
    path = storage if storage.startswith("/") else f"{workdir}/{storage}"
    assert any(path.startswith(v + "/") for v in volumes), f"{path} is not on a shared volume"
    cpus = re.search(
        r"--num-cpus=\$\{\w+:-(\d+)\}", command_text(services()["ray-worker"]["entrypoint"])
    )
    assert float(pipeline["resources"]["cpu"]) <= float(cpus[1])
    assert float(pipeline["resources"]["gpu"]) == 0


def test_readme_cluster_section() -> None:
    section = readme_cluster_section()
    for path in re.findall(r"docker/[\w./-]+\.(?:ya?ml|sh)", section):
        assert (REPO / path).is_file(), f"README names {path}, which does not exist"
    for needed in ("docker compose", "--scale ray-worker=", "kubectl apply", "#/experiments/",
                   "8265", "RAY_AUTH_TOKEN", "statically"):  # fmt: skip
        assert needed in section, f"README's cluster section does not say {needed!r}"


def _module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_script(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(DOCKER / "healthcheck.py")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr  # here: not a Ray node, dpivon imports
    health = _module(DOCKER / "healthcheck.py")
    assert health.is_ray_node("/opt/venv/bin/python /opt/venv/bin/ray start --head --block")
    assert health.is_ray_node("/sbin/docker-init -- ray start --address=ray-head:6379 --block")
    assert health.is_ray_node("/bin/bash -lc -- ulimit -n 65536; ray start --head")
    assert not health.is_ray_node("dpivon sweep pipelines/quickstart.yaml")
    assert not health.is_ray_node("python -m xray starter")
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "cmdline").write_bytes(b"ray\0start\0--head\0--block\0")
    (proc / "1" / "comm").write_text("ray\n")
    assert "no raylet" in health.check(proc)
    (proc / "77").mkdir()
    (proc / "77" / "comm").write_text("raylet\n")
    assert health.raylet_running(proc)


def test_checkers_reject_bad_input() -> None:
    """The checkers above fail on the mistakes they are meant to catch."""
    assert port_binding_problem("5000:5000")
    assert port_binding_problem("0.0.0.0:8265:8265")
    assert port_binding_problem("${BIND:-0.0.0.0}:5000:5000")
    assert port_binding_problem({"target": 5000, "published": 5000})
    assert port_binding_problem("${DPIVON_BIND:-127.0.0.1}:5000:5000") is None
    assert image_problem("postgres") and image_problem("minio/minio:latest")
    assert image_problem("postgres:15") and not image_problem("postgres:15.14-bookworm")
    assert pin_problems(["torch==2.0.0"]) and pin_problems(["mlflow"]) and pin_problems(["ray>=2"])
    assert pin_problems([f"torch=={pyproject_pins()['torch']}", "boto3==1.44.5", "."]) == []
    assert secret_value_problem("POSTGRES_PASSWORD", "mlflow")
    assert secret_value_problem("RAY_AUTH_TOKEN", "${RAY_AUTH_TOKEN:-abc}")
    assert secret_value_problem("RAY_AUTH_TOKEN_PATH", "/run/secrets/ray") is None
    assert command_problems("dpivon swep pipelines/quickstart.yaml")
    assert command_problems("dpivon sweep pipelines/nope.yaml")
    assert command_problems("dpivon sweep /opt/dpivon/pipelines/quickstart.yaml --adress auto")
    assert command_problems("dpivon sweep /opt/dpivon/pipelines/quickstart.yaml --resume") == []
    assert variable_problem("RAY_AUTH_TOKNE") and variable_problem("DPIVON_DATTA")
    assert variable_problem("MLFLOW_TRACKING_URL") and variable_problem("RAY_ADDRES")
    assert variable_problem("RAY_AUTH_TOKEN") is None
    assert interpolate("${A:-x}/${B:?need B}/${C}") == "x/<B>/<C>"
    installs = pip_installs("pip install --no-cache-dir --index-url https://x torch==1 . && ls")
    assert installs[0]["requirements"] == ["torch==1", "."]
