"""The project's exception tree.

Every error we raise on purpose is one of these; library errors are translated at the boundary
(``raise PayloadError(...) from exc``) so callers can catch by meaning, not by library::

    SparseLoCoError
    ├── PayloadError (ValueError)      a payload from the network or the store is malformed
    ├── CodecError (ValueError)        our own encoder was handed tensors it cannot encode
    └── ConfigError (ValueError)       a configuration value is invalid; the message names the fix

Each class also inherits the matching builtin, so code that only knows ``ValueError`` still
catches it.
"""

from __future__ import annotations


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


class CodecError(SparseLoCoError, ValueError):
    """The encoder was given input it cannot encode (non-finite values, bad k or tile size)."""


class ConfigError(SparseLoCoError, ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""
