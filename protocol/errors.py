"""The project's exception tree.

Every error we raise on purpose is one of these; library errors are translated at the boundary
(``raise PayloadError(...) from exc``) so callers can catch by meaning, not by library::

    SparseLoCoError
    ├── PayloadError (ValueError)      a payload from the network or the store is malformed
    ├── ManifestError (ValueError)     a manifest's signature, run or round does not check out
    ├── CodecError (ValueError)        our own encoder was handed tensors it cannot encode
    └── ConfigError (ValueError)       a configuration value is invalid; the message names the fix

Each class also inherits the matching builtin, so code that only knows ``ValueError`` still
catches it. The node (``node/errors.py``) and the coordinator (``coordinator/base/errors.py``) grow
their own branches from ``SparseLoCoError``.

``config_error`` is the one formatter of pydantic validation errors: every config tree (node
settings, coordinator config, simulator and ``up`` flags) and the coordinator's request bodies
turn a ``ValidationError`` into readable lines through it, each caller only saying how a field's
location reads to its user (a flag, an environment variable, a TOML key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError


class SparseLoCoError(Exception):
    """Base class of every error this project raises on purpose."""


class PayloadError(SparseLoCoError, ValueError):
    """A payload is malformed: truncated, corrupted, over a limit, or not for this model.

    ``field`` names the part of the payload that failed validation (``"header.magic"``,
    ``"tensors[3].indices"``...), so logs and manifests can say precisely why a peer was excluded.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ManifestError(SparseLoCoError, ValueError):
    """A manifest failed verification: bad signature, or another run or round than expected."""


class CodecError(SparseLoCoError, ValueError):
    """The encoder was given input it cannot encode (non-finite values, bad k or tile size)."""


class ConfigError(SparseLoCoError, ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""


@dataclass(frozen=True)
class Problem:
    """One failed field of a pydantic validation, in plain words."""

    loc: tuple[str | int, ...]
    #: pydantic's message without its "Value error, " prefix.
    message: str
    #: pydantic's error type ("missing", "int_parsing", "json_invalid", ...).
    kind: str
    input: Any = None

    @property
    def dotted(self) -> str:
        """The location as ``a.b.c`` (empty for the whole document)."""
        return ".".join(str(part) for part in self.loc)


def problems(exc: ValidationError) -> list[Problem]:
    """Every error of ``exc``, in pydantic's order."""
    return [
        Problem(
            loc=tuple(err["loc"]),
            message=err["msg"].removeprefix("Value error, "),
            kind=err["type"],
            input=err.get("input"),
        )
        for err in exc.errors()
    ]


def config_error(
    exc: ValidationError, render: Callable[[Problem], str], *, sep: str = "; "
) -> ConfigError:
    """A ``ConfigError`` with one ``render(problem)`` per failed field, joined by ``sep``."""
    return ConfigError(sep.join(render(p) for p in problems(exc)))
