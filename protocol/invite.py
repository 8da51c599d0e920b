"""The invite: everything a participant needs to join a run, in one string to copy and paste.

A node must learn three things from the run's operator, and the third is the one an attacker
wants to change: where the coordinator is, the node's token, and which Ed25519 key signs the
run's manifests. The join response carries the key too, but it arrives over the same connection
an attacker in the middle controls; a fingerprint that came with the token, out of band, lets
the node check it (``node.daemon.pinning``). An invite carries all three::

    sparseloco-invite:v1:<base64url of {"coordinator": URL, "token": T, "manifest_key": FP}>

``FP`` is ``sha256:`` and the hex SHA-256 of the raw 32-byte public key (``key_fingerprint``).
The token is the only secret inside; treat an invite like a token. ``sparseloco coordinator
token add NODE --invite`` makes one (``coordinator.ops.invite``), ``sparseloco node --invite``,
``doctor --invite`` and ``export --invite`` read it (``node.daemon.settings``). This module is
the one place either side builds or reads the format, so they cannot drift apart.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.errors import ConfigError

PREFIX = "sparseloco-invite:v1:"
FINGERPRINT_PREFIX = "sha256:"
_FINGERPRINT = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")


def key_fingerprint(public_key_hex: str) -> str:
    """``sha256:<hex>`` of a raw Ed25519 public key given as hex (as a join response has it)."""
    try:
        raw = bytes.fromhex(public_key_hex)
    except ValueError as exc:
        raise ConfigError(f"manifest public key {public_key_hex[:16]!r}... is not hex") from exc
    return FINGERPRINT_PREFIX + hashlib.sha256(raw).hexdigest()


def normalize_fingerprint(text: str) -> str:
    """A fingerprint as written by a person (any case, with or without ``sha256:``, colons or
    spaces between bytes) in the canonical ``sha256:<64 lowercase hex>`` form; ``ValueError``."""
    compact = re.sub(r"[\s:]", "", text.strip().lower().removeprefix(FINGERPRINT_PREFIX))
    m = _FINGERPRINT.match(compact)
    if m is None:
        raise ValueError(
            f"{text!r} is not a manifest key fingerprint; it looks like sha256: and 64 hex digits"
            " (the operator's `token add --invite` prints it)"
        )
    return FINGERPRINT_PREFIX + m.group(1)


class Invite(BaseModel):
    """What an invite carries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    coordinator: str = Field(pattern=r"^https?://", description="the coordinator's public URL")
    token: str = Field(min_length=1, description="the node's bearer token")
    manifest_key: str = Field(description="sha256:<hex> of the manifest public key")

    def encode(self) -> str:
        """The invite as one line: ``sparseloco-invite:v1:`` and unpadded base64url JSON."""
        body = json.dumps(self.model_dump(), separators=(",", ":"), sort_keys=True).encode()
        return PREFIX + base64.urlsafe_b64encode(body).decode().rstrip("=")

    def __repr__(self) -> str:  # never show the token in a traceback or a log line
        return f"Invite(coordinator={self.coordinator!r}, manifest_key={self.manifest_key!r})"

    __str__ = __repr__


def decode_invite(text: str) -> Invite:
    """Read an invite as pasted (surrounding and embedded whitespace ignored); ``ConfigError``
    with what to do if it is not one, is damaged, or is of a newer version."""
    compact = re.sub(r"\s", "", text)
    if not compact.startswith(PREFIX):
        if compact.startswith("sparseloco-invite:"):
            raise ConfigError(
                "this invite is of a newer format than this sparseloco understands; upgrade"
                " sparseloco, or ask the operator for --coordinator, the token and"
                " --manifest-key-fingerprint separately"
            )
        raise ConfigError(
            "not a sparseloco invite (it starts with sparseloco-invite:v1:); copy the"
            " whole line `sparseloco coordinator token add NODE --invite` printed"
        )
    body = compact[len(PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        invite = Invite.model_validate_json(raw)
        canonical = normalize_fingerprint(invite.manifest_key)
    except (binascii.Error, ValueError, ValidationError):
        # Not chained: pydantic's text may quote the token.
        raise ConfigError(
            "the invite is damaged (cut off or changed while copying); copy the whole"
            " line again, or ask the operator for a new one"
        ) from None
    return invite.model_copy(
        update={"manifest_key": canonical, "coordinator": invite.coordinator.rstrip("/")}
    )
