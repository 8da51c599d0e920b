"""The coordinator's exception tree, grown from ``protocol.errors.SparseLoCoError``.

The round machine and the checkpoint book refuse a request by raising; ``coordinator.handling``
turns each class into an ``ErrorBody`` with the status on the right. boto3 and botocore errors
are translated inside ``coordinator/storage.py`` (``raise StorageError(...) from exc``), so no
other module knows which library talks to the store::

    SparseLoCoError                            (protocol.errors; also ConfigError, ManifestError...)
    ├── ApiError (RuntimeError)                any status: a request refused before the machine
    │                                          saw it (bad token, bad body, no checkpoint yet)
    ├── RoundError (RuntimeError)              the round or checkpoint state refuses the request;
    │   │                                      ``.code`` is the API error code
    │   ├── UnknownRound (LookupError)   404   the round does not exist (yet)
    │   ├── Conflict                     409   well formed, but at odds with the state
    │   └── TooLarge (ValueError)        413   a checkpoint over ``max_checkpoint_bytes``
    └── StorageError (OSError)           503   the object store failed or refused; ``.code`` is
                                               the store's own error code when it sent one

``RuntimeError`` for a refused request mirrors the node's side of the same answer
(``node.errors.CoordinatorError``). ``TRANSIENT`` names the errors a background task retries.
"""

from __future__ import annotations

from protocol.errors import SparseLoCoError


class ApiError(SparseLoCoError, RuntimeError):
    """An error answered as ``ErrorBody`` with HTTP ``status``; ``field`` names the bad field."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field


class RoundError(SparseLoCoError, RuntimeError):
    """A request that the round (or checkpoint) state does not allow; ``code`` is the API code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class UnknownRound(RoundError, LookupError):
    """The request names a round that does not exist yet, or past the run's end (HTTP 404)."""

    def __init__(self, round_: int) -> None:
        super().__init__("unknown_round", f"round {round_} does not exist (yet)")


class Conflict(RoundError):
    """The request is well formed but conflicts with the state (HTTP 409)."""


class TooLarge(RoundError, ValueError):
    """The offered checkpoint exceeds the size limit (HTTP 413); ``field`` names the field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__("too_large", message)
        self.field = field


class StorageError(SparseLoCoError, OSError):
    """The object store did not answer or refused a request the coordinator needed.

    ``code`` is the store's error code (``"NoSuchKey"``, ``"404"``, ``"SlowDown"``...) when the
    store answered with one, ``None`` when it never answered (connection, timeout).
    """

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


#: Errors a background task (publisher, retention) retries: the store is down, slow or refusing
#: for now. ``StorageError`` is an ``OSError``; the wider class also covers a socket error that
#: an ``ObjectStore`` other than ``S3Store`` lets through untranslated.
TRANSIENT: tuple[type[Exception], ...] = (StorageError, OSError)
