"""The coordinator's configuration tree: one frozen pydantic-settings model per process.

Sources, highest precedence first: command-line flags, environment variables
(``SPARSELOCO_COORD_SERVER__PORT=8701``, nested with ``__``; tables such as ``TOKENS`` as JSON),
the TOML file (``--config run.toml``), then the defaults below. Sections::

    [run]       protocol.runconfig.RunConfig: what every node must agree on (its hash is the run id)
    [server]    where and how the HTTP service listens, and where it keeps its state
    [storage]   the S3-compatible object store (endpoint, bucket, prefix, credentials)
    [tokens]    node_id = "bearer token", one line per node allowed to join

Any invalid value raises ``protocol.errors.ConfigError`` whose message names the dotted field and
how to fix it; the CLI prints it and exits with status 2.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from protocol.errors import ConfigError, Problem, config_error
from protocol.keys import check_id
from protocol.runconfig import RunConfig

ENV_PREFIX = "SPARSELOCO_COORD_"
#: Shortest bearer token accepted: a guessable token lets anyone submit as that node.
MIN_TOKEN_CHARS = 16


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Section):
    """The HTTP service."""

    host: str = "127.0.0.1"
    #: 0 picks a free port; the chosen URL is written to ``{state_dir}/coordinator.json``.
    port: int = Field(8700, ge=0, le=65535)
    #: SQLite database, manifest signing key and ``coordinator.json`` live here.
    state_dir: Path
    max_body_bytes: int = Field(65536, ge=1024)
    presign_expiry_s: int = Field(900, ge=1, le=7 * 24 * 3600)
    manifest_wait_max_s: float = Field(60.0, ge=0)
    status_rounds: int = Field(20, ge=1, le=100000)


class StorageConfig(_Section):
    """An S3-compatible object store: AWS S3, Cloudflare R2, MinIO or SeaweedFS."""

    endpoint_url: str = Field(pattern=r"^https?://")
    bucket: str = Field(min_length=3, max_length=63)
    prefix: str = ""
    region: str = "us-east-1"
    access_key: str = Field(min_length=1)
    secret_key: str = Field(min_length=1)
    max_payload_bytes: int = Field(268435456, ge=1)
    #: Largest checkpoint (safetensors file) a node may upload.
    max_checkpoint_bytes: int = Field(16 * 1024**3, ge=1)


class CoordinatorConfig(BaseSettings):
    """Everything one coordinator process needs."""

    model_config = SettingsConfigDict(
        extra="forbid",
        frozen=True,
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        nested_model_default_partial_update=False,
    )

    run: RunConfig = RunConfig()
    server: ServerConfig
    storage: StorageConfig
    #: node_id -> bearer token.
    tokens: dict[str, str] = Field(min_length=1)

    @field_validator("tokens")
    @classmethod
    def _check_tokens(cls, tokens: dict[str, str]) -> dict[str, str]:
        for node_id, token in tokens.items():
            check_id("node id", node_id)
            if len(token) < MIN_TOKEN_CHARS:
                raise ValueError(
                    f"token of {node_id!r} is shorter than {MIN_TOKEN_CHARS} characters;"
                    " generate one with `python -c 'import secrets; print(secrets.token_hex(16))'`"
                )
        if len(set(tokens.values())) != len(tokens):
            raise ValueError("two nodes share a token; give every node its own")
        return tokens

    @property
    def run_id(self) -> str:
        return self.run.run_id

    def node_for_token(self) -> dict[str, str]:
        """token -> node_id, for authentication."""
        return {token: node_id for node_id, token in self.tokens.items()}


def _read_toml(path: Path) -> dict[str, Any]:
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


def _fix_hint(loc: str) -> str:
    env = ENV_PREFIX + loc.upper().replace(".", "__")
    section, _, key = loc.partition(".")
    where = f"[{section}] {key}" if key else section
    return f"set {where} in the TOML file, or env {env}"


def _describe(problem: Problem) -> str:
    """One failed field as a line: what is wrong, what was given, and where to set it."""
    loc = problem.dotted
    got = "" if problem.kind == "missing" else f" (got {problem.input!r})"
    return f"config field {loc or '(root)'}: {problem.message}{got}; {_fix_hint(loc)}"


def load_config(
    path: str | Path | None, overrides: dict[str, Any] | None = None
) -> CoordinatorConfig:
    """Build the config from ``path`` (TOML), the environment and ``overrides`` (flags).

    ``overrides`` is nested like the file (``{"server": {"port": 0}}``); ``None`` values are
    dropped so absent flags do not hide the file. Raises ``ConfigError`` on any invalid value.
    """
    file_values = _read_toml(Path(path)) if path is not None else {}
    flag_values = _drop_none(overrides or {})

    class _Sources(CoordinatorConfig):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, InitSettingsSource(settings_cls, file_values))

    try:
        loaded = _Sources(**flag_values)
    except ValidationError as exc:
        raise config_error(exc, _describe, sep="\n") from exc
    # Hand back the plain class so callers never see the per-call subclass.
    return CoordinatorConfig.model_construct(**dict(loaded))


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            inner = _drop_none(value)
            if inner:
                out[key] = inner
        elif value is not None:
            out[key] = value
    return out
