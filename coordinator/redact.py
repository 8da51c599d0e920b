"""Secrets are never printed: how values are shown in errors, and a filter for every log line.

The coordinator holds two kinds of secrets: the object store's credentials
(``storage.access_key``, ``storage.secret_key``) and the nodes' bearer tokens (the config's
``[tokens]`` table; the database keeps only their digests). Two guards keep them out of
anything a person or a log collector reads:

- ``shown``: what a config error may say about a value it refuses. Never the value of a secret
  field, of an unknown key (a misspelt ``secret_kye`` holds the secret all the same) or of
  anything under ``[tokens]``; of a table only its keys.
- ``SecretFilter``: a logging filter, installed on the process's handlers once the config is
  loaded, that replaces every known secret string in a formatted line (message, arguments and
  traceback) with ``***``; ``scrub`` does the same for one string (a start-up error message).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

#: Field names whose values are secret wherever they appear.
SECRET_FIELDS = frozenset({"access_key", "secret_key"})
#: Sections whose every value is secret.
SECRET_SECTIONS = frozenset({"tokens"})
#: Secrets shorter than this are not scrubbed from text (they would mask ordinary words); the
#: config refuses tokens that short anyway, and ``shown`` guards secret fields by name.
MIN_SCRUB_CHARS = 8
MASK = "***"


def is_secret(loc: tuple[str | int, ...]) -> bool:
    """Whether the config value at ``loc`` (``("storage", "secret_key")``) is a secret."""
    return bool(loc) and (loc[0] in SECRET_SECTIONS or loc[-1] in SECRET_FIELDS)


def shown(loc: tuple[str | int, ...], value: Any, *, unknown_key: bool = False) -> str | None:
    """``value`` as a config error may show it, or ``None`` when it must not be shown at all."""
    if unknown_key or is_secret(loc):
        return None
    if isinstance(value, Mapping):
        keys = ", ".join(str(k) for k in value)
        return f"a table with keys {keys}" if keys else "an empty table"
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def secrets_in(values: Mapping[str, Any]) -> set[str]:
    """Every secret string in a config tree (as read from TOML, the environment or flags)."""
    found: set[str] = set()

    def walk(node: Any, loc: tuple[str, ...]) -> None:
        if isinstance(node, Mapping):
            for key, child in node.items():
                walk(child, (*loc, str(key)))
        elif isinstance(node, str) and is_secret(loc):
            found.add(node)

    walk(values, ())
    return found


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret (longest first, so none is left half-masked) as ``***``."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        if len(secret) >= MIN_SCRUB_CHARS:
            text = text.replace(secret, MASK)
    return text


class SecretFilter(logging.Filter):
    """Masks the given secrets in every record that passes a handler it is attached to."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.secrets = sorted({s for s in secrets if len(s) >= MIN_SCRUB_CHARS}, key=len)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = scrub(message, self.secrets)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text, self.secrets)
        return True


def install(secrets: Iterable[str], logger: logging.Logger | None = None) -> SecretFilter:
    """Attach one ``SecretFilter`` to every handler of ``logger`` (the root logger)."""
    target = logger or logging.getLogger()
    secret_filter = SecretFilter(secrets)
    for handler in target.handlers:
        handler.addFilter(secret_filter)
    return secret_filter
