"""The node daemon's configuration: where the coordinator is, who we are, where state lives.

One frozen pydantic-settings tree, filled with this precedence: command-line flags, then
environment variables (``SPARSELOCO_NODE_TOKEN``, ``SPARSELOCO_NODE_STATE_DIR``...), then the
defaults here. The token is best passed in the environment, where other users of the machine
cannot read it from the process list. Everything about the *run* (model, codec, H) comes from
the coordinator at join and is not configured here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.errors import Problem, config_error


class NodeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPARSELOCO_NODE_", extra="forbid", frozen=True)

    coordinator: str = Field(description="coordinator base URL, e.g. https://coord.example:8700")
    token: str = Field(min_length=1, description="join token issued by the coordinator operator")
    state_dir: Path = Field(description="local state (θ, error buffer, AdamW, round)")
    data: str | None = Field(None, description="text file, directory or glob; default: bundled")
    #: torch intra-op threads for this node's compute (0: torch's default).
    threads: int = Field(0, ge=0)
    eval_batches: int = Field(4, ge=1)
    eval_batch_size: int = Field(8, ge=1)
    #: Evaluate the held-out loss every this many rounds (0: never).
    eval_every: int = Field(1, ge=0)
    parallel_downloads: int = Field(8, ge=1)
    connect_timeout_s: float = Field(10.0, gt=0)
    request_timeout_s: float = Field(30.0, gt=0)
    transfer_timeout_s: float = Field(120.0, gt=0)
    #: How long the coordinator or the store may be unreachable before the node gives up
    #: (default: never; an outage of any length is waited out).
    outage_budget_s: float = Field(math.inf, gt=0)
    #: Seconds a stop request (SIGTERM, Ctrl-C) waits for the round in hand before it is cut.
    stop_grace_s: float = Field(3.0, ge=0)

    @field_validator("coordinator")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r} is not an http(s) URL; e.g. http://127.0.0.1:8700")
        return value.rstrip("/")


def load_settings(**flags: Any) -> NodeSettings:
    """Settings from flags (``None`` means not given) over the environment; ``ConfigError``."""
    given = {k: v for k, v in flags.items() if v is not None}
    try:
        return NodeSettings(**given)
    except ValidationError as exc:
        raise config_error(exc, _flag_or_env) from exc


def _flag_or_env(problem: Problem) -> str:
    """``--state-dir (or SPARSELOCO_NODE_STATE_DIR): <message>``."""
    name = "-".join(str(p) for p in problem.loc).replace("_", "-")
    env = "SPARSELOCO_NODE_" + name.replace("-", "_").upper()
    return f"--{name} (or {env}): {problem.message}"
