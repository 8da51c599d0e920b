"""The node's configuration: where the coordinator is, who we are, whom we trust, where state
lives.

One frozen pydantic-settings tree, filled with this precedence: command-line flags, then an
invite given as a flag (``--invite``), then environment variables (``SPARSELOCO_NODE_TOKEN``,
``SPARSELOCO_NODE_STATE_DIR``...), then an invite in the environment
(``SPARSELOCO_NODE_INVITE``), then the defaults here. An invite (``protocol.invite``) stands for
``--coordinator``, ``--token`` and ``--manifest-key-fingerprint`` at its own level, so an
explicit flag still wins over it. The token is best passed in the environment (or in an
invite there), where other users of the machine cannot read it from the process list.
Everything about the *run* (model, codec, H) comes from the coordinator at join and is not
configured here.

``ConnectionSettings`` is the part ``sparseloco doctor`` and ``export`` share with the node:
the coordinator, the token, the pinned manifest key and how TLS is checked
(``node.daemon.tls``); ``NodeSettings`` adds the rest.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from node.daemon.ratelimit import parse_rate
from node.daemon.tls import check_coordinator_url
from protocol.bounds import Count, Natural, NonNegative, Positive
from protocol.errors import ConfigError, Problem, config_error
from protocol.invite import decode_invite, normalize_fingerprint

ENV_PREFIX = "SPARSELOCO_NODE_"
#: The environment variable holding an invite (not a field: it expands into three).
INVITE_ENV = ENV_PREFIX + "INVITE"

S = TypeVar("S", bound="ConnectionSettings")


class ConnectionSettings(BaseSettings):
    """How to reach the coordinator, as whom, and what to trust."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    coordinator: str = Field(description="coordinator base URL, e.g. https://coord.example:8700")
    token: str | None = Field(None, min_length=1, description="join token from the operator")
    #: ``sha256:<hex>`` of the manifest public key, from the operator; checked at the first join
    #: (``node.daemon.pinning``). None: the key of the first join is trusted from then on.
    manifest_key_fingerprint: str | None = None
    #: PEM file of the CA (or self-signed certificate) to trust besides the system store.
    ca_cert: Path | None = None
    #: Plain http:// to a host other than this machine (otherwise refused).
    allow_insecure_http: bool = False

    @field_validator("manifest_key_fingerprint")
    @classmethod
    def _fingerprint(cls, value: str | None) -> str | None:
        return None if value is None else normalize_fingerprint(value)

    @field_validator("ca_cert")
    @classmethod
    def _ca_file(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"{value} is not a file; give the PEM file of the run's CA")
        return value

    @field_validator("coordinator")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_coordinator_url(value, allow_insecure_http=True)  # the shape only

    @model_validator(mode="after")
    def _transport(self: S) -> S:
        # After the fields, so the check sees --allow-insecure-http whatever the order.
        check_coordinator_url(self.coordinator, allow_insecure_http=self.allow_insecure_http)
        return self


class NodeSettings(ConnectionSettings):
    token: str = Field(min_length=1, description="join token issued by the coordinator operator")
    state_dir: Path = Field(description="local state (θ, error buffer, AdamW, round)")
    data: str | None = Field(None, description="text file, directory or glob; default: bundled")
    #: torch intra-op threads for this node's compute (0: torch's default).
    threads: Natural = 0
    #: Where the inner steps run: ``auto`` (the first GPU if torch sees one, else the CPU),
    #: ``cpu`` or ``cuda[:N]`` (``node.compute.placement``); θ stays on the CPU either way.
    device: str = Field("auto", description="auto, cpu or cuda[:N]")
    eval_batches: Count = 4
    eval_batch_size: Count = 8
    #: Evaluate the held-out loss every this many rounds (0: never); unset, the run's own
    #: schedule (``RunConfig.eval_every``) decides.
    eval_every: Natural = 1
    parallel_downloads: Count = 8
    connect_timeout_s: Positive = 10.0
    request_timeout_s: Positive = 30.0
    transfer_timeout_s: Positive = 120.0
    #: How long the coordinator or the store may be unreachable before the node gives up
    #: (default: never; an outage of any length is waited out).
    outage_budget_s: Positive = math.inf
    #: Seconds a stop request (SIGTERM, Ctrl-C) waits for the round in hand before it is cut.
    stop_grace_s: NonNegative = 3.0
    #: Caps on this node's transfers to and from the store, in bytes per second (given as
    #: ``100Mbit``, ``12.5MB``...: ``node.daemon.ratelimit``); None: uncapped.
    upload_limit: Positive | None = None
    download_limit: Positive | None = None

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return check_device_spec(value)

    @field_validator("upload_limit", "download_limit", mode="before")
    @classmethod
    def _rate(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return parse_rate(value)
        except ConfigError as exc:  # as a validation error, so the message names the flag
            raise ValueError(str(exc)) from None


#: What ``--device`` takes (checked without importing torch; resolved at start).
DEVICE_SPEC = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def check_device_spec(value: str) -> str:
    """``value`` if it names a device the node knows (auto, cpu, cuda, cuda:N); else ValueError."""
    if not DEVICE_SPEC.fullmatch(value):
        raise ValueError(f"{value!r} is not a device; give auto, cpu, cuda or cuda:N (e.g. cuda:0)")
    return value


#: The settings an invite fills, by field.
INVITE_FIELDS = ("coordinator", "token", "manifest_key_fingerprint")


def with_invites(
    flags: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``flags`` (``None``: not given) with the invites expanded by the module's precedence:
    the ``invite`` flag's fields under the explicit flags, ``SPARSELOCO_NODE_INVITE``'s under
    the explicit environment variables. ``ConfigError`` for an invite that cannot be read."""
    env = os.environ if environ is None else environ
    given = {k: v for k, v in flags.items() if v is not None and k != "invite"}
    sources = [(flags.get("invite"), False), (env.get(INVITE_ENV) or None, True)]
    for text, from_env in sources:
        if text is None:
            continue
        try:
            invite = decode_invite(str(text))
        except ConfigError as exc:
            raise ConfigError(f"{INVITE_ENV if from_env else '--invite'}: {exc}") from None
        values = dict(
            zip(INVITE_FIELDS, (invite.coordinator, invite.token, invite.manifest_key), strict=True)
        )
        for name, value in values.items():
            if name in given or (from_env and (ENV_PREFIX + name.upper()) in env):
                continue
            given[name] = value
    return given


def load_settings(**flags: Any) -> NodeSettings:
    """Settings from flags (``None`` means not given; ``invite`` expands) over the environment;
    ``ConfigError`` naming the flag and its variable."""
    return _load(NodeSettings, flags)


def load_connection(**flags: Any) -> ConnectionSettings:
    """What ``doctor`` and ``export`` need, by the same rules as ``load_settings``."""
    return _load(ConnectionSettings, flags)


def _load(cls: type[S], flags: Mapping[str, Any]) -> S:
    given = with_invites(flags)
    try:
        return cls(**given)
    except ValidationError as exc:
        raise config_error(exc, _flag_or_env) from exc


def _flag_or_env(problem: Problem) -> str:
    """``--state-dir (or SPARSELOCO_NODE_STATE_DIR): <message>``."""
    if not problem.loc:  # a check across fields names its flags itself
        return problem.message
    name = "-".join(str(p) for p in problem.loc).replace("_", "-")
    env = ENV_PREFIX + name.replace("-", "_").upper()
    return f"--{name} (or {env}): {problem.message}"
