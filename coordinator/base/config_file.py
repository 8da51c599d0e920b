"""The coordinator's TOML file and environment, read raw: what the token commands need, fast.

``coordinator.base.config`` validates the whole tree with pydantic-settings, which pulls in the
server's libraries (aiohttp for the limits, among others) and takes seconds to import on a busy
machine. ``sparseloco coordinator token add|list|revoke`` needs only the state directory (and
``token add --invite`` the ``[server]`` table for the public URL), so those are read here with
the same precedence as ``coordinator.base.config`` (flag, then environment, then file) and nothing
else is imported. No value is validated here beyond its type; the server validates at start.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from protocol.errors import ConfigError

#: Environment variables that configure the coordinator start with this
#: (``coordinator.base.config``).
ENV_PREFIX = "SPARSELOCO_COORD_"


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict; ``ConfigError`` saying what to fix otherwise."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"config file {path} does not exist; pass --config with the path of a TOML file"
            " (see deploy/run.example.toml)"
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def state_dir_of(path: str | Path | None, flag: str | Path | None = None) -> Path:
    """Where a coordinator with this config keeps its state, by the same precedence as ``serve``
    (``--state-dir``, the environment, the file), without validating the rest of the config:
    the token commands need no store credentials. ``ConfigError`` if none says."""
    if flag is not None:
        return Path(flag)
    env = os.environ.get(ENV_PREFIX + "SERVER__STATE_DIR")
    if env:
        return Path(env)
    if path is not None:
        server = read_toml(Path(path)).get("server")
        if isinstance(server, dict) and isinstance(server.get("state_dir"), str):
            return Path(server["state_dir"])
        raise ConfigError(f"config file {path} has no [server] state_dir; pass --state-dir")
    raise ConfigError("say which coordinator: --config run.toml or --state-dir DIR")


def server_values(path: str | Path | None) -> dict[str, Any]:
    """The ``[server]`` table as the file and the environment give it, unvalidated (what
    ``coordinator.ops.invite`` derives the public URL from; no store credentials needed)."""
    values: dict[str, Any] = {}
    if path is not None:
        server = read_toml(Path(path)).get("server")
        values = dict(server) if isinstance(server, dict) else {}
    prefix = ENV_PREFIX + "SERVER__"
    for name, value in os.environ.items():
        if name.startswith(prefix):
            values[name[len(prefix) :].lower()] = value
    return values
