"""The coordinator's exception tree, grown from ``protocol.errors.SparseLoCoError``.

The round machine and the checkpoint book refuse a request by raising; ``coordinator.api.handling``
turns each class into an ``ErrorBody`` with the status on the right. boto3 and botocore errors
are translated inside ``coordinator/store/storage.py`` (``raise StorageError(...) from exc``), so no
other module knows which library talks to the store::

    SparseLoCoError                            (protocol.errors; also ConfigError, ManifestError...)
    ├── ApiError (RuntimeError)                any status: a request refused before the machine
    │   │                                      saw it (bad token, revoked token, bad body...)
    │   └── RateLimited                  429   too many failed authentications from the address,
    │                                          or requests from the node; ``.retry_after_s``
    ├── RoundError (RuntimeError)              the round or checkpoint state refuses the request;
    │   │                                      ``.code`` is the API error code
    │   ├── UnknownRound (LookupError)   404   the round does not exist (yet)
    │   ├── Conflict                     409   well formed, but at odds with the state
    │   │   ├── TokenInUse               409   another process holds this node's membership;
    │   │   │                                  ``.retry_after_s`` until it may be taken over
    │   │   └── BadCheckpoint            409   the uploaded checkpoint file failed verification
    │   │                                      (size, sha256 or fingerprint); it was deleted
    │   └── TooLarge (ValueError)        413   a checkpoint over ``max_checkpoint_bytes``
    ├── StorageError (OSError)           503   the object store failed or refused; ``.code`` is
    │                                          the store's own error code when it sent one
    ├── StartupError (RuntimeError)            a start-up check failed (port in use, store
    │                                          unreachable, credentials, bucket): nothing was
    │                                          written, the process exits with status 1
    ├── TokenAdminError (ValueError)           ``coordinator token ...`` refused (a node that
    │                                          already has a token, nothing to revoke, no
    │                                          database in the state directory)
    └── BackupError (ValueError)               ``coordinator backup|restore`` refused (no state
                                               to back up, a damaged or foreign archive, a
                                               state directory that is not empty)

``RuntimeError`` for a refused request mirrors the node's side of the same answer
(``node.errors.CoordinatorError``). ``TRANSIENT`` names the errors a background task retries.
"""

from __future__ import annotations

import math

from protocol.errors import SparseLoCoError


class ApiError(SparseLoCoError, RuntimeError):
    """An error answered as ``ErrorBody`` with HTTP ``status``; ``field`` names the bad field."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field


class RateLimited(ApiError):
    """Over a rate limit (HTTP 429); ``retry_after_s`` is when the next request may succeed."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(429, "rate_limited", message)
        self.retry_after_s = retry_after_s
        #: Whole seconds, as the ``Retry-After`` header says.
        self.wait_s = max(1, math.ceil(retry_after_s))


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


class TokenInUse(Conflict):
    """Another process (instance) holds this node's active membership (HTTP 409).

    ``retry_after_s`` is how long until that process counts as gone if it stays silent.
    """

    def __init__(self, node_id: str, retry_after_s: float) -> None:
        #: Whole seconds to wait, as the message and the ``Retry-After`` header say.
        self.wait_s = max(1, math.ceil(retry_after_s))
        super().__init__(
            "token_in_use",
            f"another process is using the token of {node_id}; stop it, or wait {self.wait_s} s"
            " for the coordinator to count it as gone",
        )
        self.retry_after_s = retry_after_s


class BadCheckpoint(Conflict):
    """The stored checkpoint file is not what was offered, or not the nodes' θ (HTTP 409)."""

    def __init__(self, message: str) -> None:
        super().__init__("bad_checkpoint", message)


class TooLarge(RoundError, ValueError):
    """The offered checkpoint exceeds the size limit (HTTP 413); ``field`` names the field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__("too_large", message)
        self.field = field


#: Store error codes that mean "not now" (its HTTP 5xx and throttling, as S3 stores spell them).
UNAVAILABLE_CODES = frozenset(
    {"500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown"}
)


class StorageError(SparseLoCoError, OSError):
    """The object store did not answer or refused a request the coordinator needed.

    ``code`` is the store's error code (``"NoSuchKey"``, ``"404"``, ``"SlowDown"``...) when the
    store answered with one, ``None`` when it never answered (connection, timeout).
    """

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code

    @property
    def unreachable(self) -> bool:
        """The store did not answer, or answered that it cannot serve now (5xx, throttled):
        an outage to wait out, not a refusal of this request."""
        return self.code is None or self.code in UNAVAILABLE_CODES


class StartupError(SparseLoCoError, RuntimeError):
    """A check before serving failed; the message says what and how to fix it (no secrets)."""


class TokenAdminError(SparseLoCoError, ValueError):
    """An operator's token command cannot be done as asked; the message says why."""


class BackupError(SparseLoCoError, ValueError):
    """A backup cannot be taken or restored as asked (no state, a damaged or foreign file)."""


#: Errors a background task (publisher, retention) retries: the store is down, slow or refusing
#: for now. ``StorageError`` is an ``OSError``; the wider class also covers a socket error that
#: an ``ObjectStore`` other than ``S3Store`` lets through untranslated.
TRANSIENT: tuple[type[Exception], ...] = (StorageError, OSError)
