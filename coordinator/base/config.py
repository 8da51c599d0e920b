"""The coordinator's configuration tree: one frozen pydantic-settings model per process.

Sources, highest precedence first: command-line flags, environment variables
(``SPARSELOCO_COORD_SERVER__PORT=8701``, nested with ``__``; tables such as ``TOKENS`` as JSON),
the TOML file (``--config run.toml``), then the defaults below. Sections::

    [run]       protocol.runconfig.RunConfig: what every node must agree on (its hash is the run id)
    [server]    where and how the HTTP service listens, and where it keeps its state
    [storage]   the S3-compatible object store (endpoint, bucket, prefix, credentials)
    [limits]    coordinator.base.limits.LimitsConfig: rate limits and request timeouts per client
    [tokens]    node_id = "bearer token": seeds the token database (``coordinator.rules.tokens``)

Any invalid value raises ``protocol.errors.ConfigError`` whose message names the dotted field and
how to fix it; the CLI prints it and exits with status 2. An unknown key is named with the
closest known one ("did you mean server.port?"). Values in the TOML file are checked strictly
(``topk = "64"`` is an error, not 64): the file has types, and a quoted number is a mistake worth
a message. Environment variables are text by nature and are converted as usual. No error shows
a secret: not the store's keys, not a token, not the value of a misspelt key
(``coordinator.base.redact``).
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from coordinator.base.config_file import ENV_PREFIX, read_toml
from coordinator.base.limits import LimitsConfig
from coordinator.base.redact import scrub, secrets_in, shown
from protocol.bounds import Count, NonNegative
from protocol.errors import ConfigError, Problem, problems
from protocol.keys import check_id
from protocol.runconfig import RunConfig

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
    manifest_wait_max_s: NonNegative = 60.0
    status_rounds: int = Field(20, ge=1, le=100000)
    #: PEM certificate chain and private key: with both set the coordinator serves HTTPS itself
    #: (``coordinator.ops.server``); else plain HTTP, for loopback or behind a TLS proxy.
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                "set both tls_cert and tls_key (the certificate chain and its private key, PEM),"
                " or neither"
            )
        return self


class StorageConfig(_Section):
    """An S3-compatible object store: AWS S3, Cloudflare R2, MinIO, SeaweedFS... (what each
    keeps of the project's promises: docs/stores.md, ``sparseloco store check``)."""

    endpoint_url: str = Field(pattern=r"^https?://")
    bucket: str = Field(min_length=3, max_length=63)
    prefix: str = ""
    region: str = "us-east-1"
    access_key: str = Field(min_length=1)
    secret_key: str = Field(min_length=1)
    max_payload_bytes: Count = 268435456
    #: Largest checkpoint (safetensors file) a node may upload. The coordinator streams each one
    #: back to verify it (``coordinator.store.verify``: one chunk in memory at a time), so this
    #: bounds the download and its time, not the coordinator's memory.
    max_checkpoint_bytes: Count = 16 * 1024**3
    #: Start even where the store does not bind an upload's bytes to its presigned URL (a signed
    #: length or sha256, or the signature itself, not enforced: ``coordinator.store.promises``).
    #: Nodes still check every payload against the signed manifest; SECURITY.md says what is
    #: lost.
    accept_unbound_uploads: bool = False


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
    limits: LimitsConfig = LimitsConfig()
    #: node_id -> bearer token, added to the token database at start for nodes it has none of.
    tokens: dict[str, str] = Field(default_factory=dict)

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

    def secrets(self) -> set[str]:
        """The strings no log line may show: the store's keys and the config's tokens."""
        return {self.storage.access_key, self.storage.secret_key, *self.tokens.values()}


#: Each section of the file and the type its table must have (for the strict type check).
SECTIONS: dict[str, Any] = {
    "run": RunConfig,
    "server": ServerConfig,
    "storage": StorageConfig,
    "limits": LimitsConfig,
    "tokens": dict[str, str],
}


def _fix_hint(loc: str) -> str:
    env = ENV_PREFIX + loc.upper().replace(".", "__")
    section, _, key = loc.partition(".")
    where = f"[{section}] {key}" if key else section
    return f"set {where} in the TOML file, or env {env}"


def _describe(problem: Problem) -> str:
    """One failed field as a line: what is wrong, what was given, and where to set it."""
    if problem.kind == "extra_forbidden":
        return _unknown_key(problem.loc)
    loc = problem.dotted
    value = None if problem.kind == "missing" else shown(problem.loc, problem.input)
    got = "" if value is None else f" (got {value})"
    return f"config field {loc or '(root)'}: {problem.message}{got}; {_fix_hint(loc)}"


def _keys_at(parent: tuple[str | int, ...]) -> list[str]:
    """The keys the config accepts in the table at ``parent`` (``()`` is the top level)."""
    model: type[BaseModel] = CoordinatorConfig
    for part in parent:
        field = model.model_fields.get(str(part))
        inner = field.annotation if field is not None else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return []
        model = inner
    return list(model.model_fields)


def _unknown_key(loc: tuple[str | int, ...]) -> str:
    """An unknown key, with the closest known one; never its value (it may be a secret)."""
    parent, key = loc[:-1], str(loc[-1])
    known = _keys_at(parent)
    dotted = ".".join(str(p) for p in loc)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not parent:
        fix = f"did you mean [{close[0]}]?" if close else "remove it"
        return f"config field {dotted}: unknown section; {fix} (sections: {', '.join(known)})"
    where = ".".join(str(p) for p in parent)
    fix = f"did you mean {where}.{close[0]}?" if close else "remove it"
    return f"config field {dotted}: unknown key; {fix} (known in [{where}]: {', '.join(known)})"


def _strict_types(file_values: dict[str, Any]) -> list[str]:
    """The file's values of the wrong type, as lines (a TOML string is never read as a number).

    Only type errors count here: missing fields (perhaps in the environment), unknown keys and
    range errors are the full validation's to report.
    """
    lines: list[str] = []
    for section, kind in SECTIONS.items():
        values = file_values.get(section)
        if not isinstance(values, dict):
            continue
        try:
            raw = json.dumps(values, default=str)
            TypeAdapter(kind).validate_json(raw, strict=True)
        except ValidationError as exc:
            for problem in problems(exc):
                if not problem.kind.endswith("_type"):
                    continue
                loc = (section, *problem.loc)
                dotted = ".".join(str(p) for p in loc)
                value = shown(loc, problem.input)
                got = "" if value is None else f" (got {value})"
                lines.append(
                    f"config field {dotted}: {problem.message}{got}; TOML values are not"
                    f" converted: write [{section}] {'.'.join(map(str, problem.loc))} with the"
                    " right type (a number without quotes, true/false, a quoted string)"
                )
    return lines


def _env_secrets() -> set[str]:
    """Secret values given in the environment (``SPARSELOCO_COORD_STORAGE__SECRET_KEY``...)."""
    found: set[str] = set()
    for name, value in os.environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key.startswith("tokens"):
            try:
                tokens = json.loads(value)
            except ValueError:
                tokens = value
            found |= set(tokens.values()) if isinstance(tokens, dict) else {str(tokens)}
        elif key.endswith(("access_key", "secret_key")):
            found.add(value)
    return {s for s in found if isinstance(s, str)}


def load_config(
    path: str | Path | None, overrides: dict[str, Any] | None = None
) -> CoordinatorConfig:
    """Build the config from ``path`` (TOML), the environment and ``overrides`` (flags).

    ``overrides`` is nested like the file (``{"server": {"port": 0}}``); ``None`` values are
    dropped so absent flags do not hide the file. Raises ``ConfigError`` on any invalid value.
    """
    file_values = read_toml(Path(path)) if path is not None else {}
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

    lines = _strict_types(file_values)
    try:
        loaded = _Sources(**flag_values)
    except ValidationError as exc:
        lines += [_describe(p) for p in problems(exc)]
    if lines:
        secrets = secrets_in(file_values) | secrets_in(flag_values) | _env_secrets()
        raise ConfigError(scrub("\n".join(lines), secrets))
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
