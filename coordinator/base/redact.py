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

A run has a token per node, so the filter must not cost a search per secret on every log line
(a thousand searches per line at a thousand nodes made logging the coordinator's largest cost).
It groups the secrets by length and, for each length present, cuts the line into every window of
that length and looks the windows up in a set: the work grows with the line, not the secrets.
The filter first makes one such pass for the secrets' first characters (as many as the shortest
secret has), all lengths at once: almost every line holds none, and is then left as it is.
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
        # The whole table a rule across its fields refused: its keys would only be noise.
        return f"a table of {len(value)} keys" if value else "an empty table"
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


def by_length(secrets: Iterable[str]) -> dict[int, frozenset[str]]:
    """The secrets long enough to scrub, grouped by length (longest first)."""
    groups: dict[int, set[str]] = {}
    for secret in secrets:
        if len(secret) >= MIN_SCRUB_CHARS:
            groups.setdefault(len(secret), set()).add(secret)
    return {n: frozenset(groups[n]) for n in sorted(groups, reverse=True)}


def mask(text: str, groups: Mapping[int, frozenset[str]]) -> str:
    """``text`` with every secret of ``groups`` (``by_length``) as ``***``, longest first, so
    none is left half-masked."""
    for length, secrets in groups.items():
        if length > len(text):
            continue
        windows = {text[i : i + length] for i in range(len(text) - length + 1)}
        for secret in windows & secrets:
            text = text.replace(secret, MASK)
    return text


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret (longest first, so none is left half-masked) as ``***``."""
    return mask(text, by_length(secrets))


class SecretFilter(logging.Filter):
    """Masks the given secrets in every record that passes a handler it is attached to."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.groups = by_length(secrets)
        #: How many first characters of every secret ``heads`` holds (the shortest's length).
        self.head_chars = min(self.groups, default=0)
        self.heads = frozenset(
            secret[: self.head_chars] for group in self.groups.values() for secret in group
        )

    def may_hold(self, text: str) -> bool:
        """Whether ``text`` may hold a secret: some window of it starts one (never a wrong
        no, so a line that fails this needs no masking)."""
        n = self.head_chars
        return not self.heads.isdisjoint(text[i : i + n] for i in range(len(text) - n + 1))

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.may_hold(message):
            clean = mask(message, self.groups)
            if clean != message:
                record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = mask(record.exc_text, self.groups)
        return True


def install(secrets: Iterable[str], logger: logging.Logger | None = None) -> SecretFilter:
    """Attach one ``SecretFilter`` to every handler of ``logger`` (the root logger)."""
    target = logger or logging.getLogger()
    secret_filter = SecretFilter(secrets)
    for handler in target.handlers:
        handler.addFilter(secret_filter)
    return secret_filter
