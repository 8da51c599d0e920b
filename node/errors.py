"""The node's exception tree, grown from ``protocol.errors.SparseLoCoError``.

Library errors (aiohttp, safetensors, the file system) are translated where they happen, with
``raise ... from exc``, so the round loop decides by meaning::

    SparseLoCoError                          (protocol.errors; also PayloadError, ManifestError...)
    ├── DataError (ValueError)               the training data cannot be used
    ├── StateError (ValueError)              the local state file exists but cannot be used
    ├── CheckpointError (ValueError)         a checkpoint's contents do not match its claims
    ├── CoordinatorError (RuntimeError)      the coordinator refused a request (``.error`` code)
    ├── TransferError (RuntimeError)         a transfer failed for good (``.status``: 403, 404...)
    │   └── DigestError                      the bytes differ from the promised size or sha256
    ├── TransientError (ConnectionError)     worth retrying: 5xx, 429, a dropped connection
    ├── RetriesExhausted (ConnectionError)   transient failures used up their attempts or budget;
    │                                        never retried again by an outer retry
    ├── Refused (RuntimeError)               a refusal that cannot heal by waiting (revoked
    │                                        token, another run, a manifest key or TLS
    │                                        certificate it must not trust); says what to do
    ├── ResyncError (RuntimeError)           resynchronising did not help, repeatedly: the node
    │                                        stops instead of looping resync, replay, diverge
    ├── StoreStartError (RuntimeError)       the embedded object store did not start
    ├── DeviceError (RuntimeError)           the training device asked for is not on this machine
    ├── RanksError (RuntimeError)            a node's torchrun processes lost each other
    └── UpError (RuntimeError)               a part of ``sparseloco up`` failed

    Abandoned (Exception)                    not an error: training stopped between inner steps
                                             because the node is shutting down
"""

from __future__ import annotations

from protocol.errors import SparseLoCoError


class DataError(SparseLoCoError, ValueError):
    """The training data cannot be used: nothing matched, unreadable, or too small."""


class StateError(SparseLoCoError, ValueError):
    """The local state file exists but cannot be used (corrupt, other run, other model)."""


class CheckpointError(SparseLoCoError, ValueError):
    """A checkpoint's contents do not match what it claims (fingerprint, names, shapes)."""


class CoordinatorError(SparseLoCoError, RuntimeError):
    """The coordinator refused a request; ``error`` is its machine-readable code."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(f"coordinator said {status} {error}: {message}")
        self.status = status
        self.error = error


class TransferError(SparseLoCoError, RuntimeError):
    """A transfer failed for a reason a retry will not fix (403 expired URL, 404 missing...)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class DigestError(TransferError):
    """Downloaded bytes differ from the size or sha256 the manifest promised."""


class TransientError(SparseLoCoError, ConnectionError):
    """A failure worth retrying (5xx, 429, a dropped connection); carries what happened, and for
    an HTTP answer its ``status`` and the coordinator's ``error`` code when it sent one (503
    ``storage_unavailable``: the coordinator answers, its object store does not)."""

    def __init__(self, message: str, status: int | None = None, error: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error = error


class RetriesExhausted(SparseLoCoError, ConnectionError):
    """An operation kept failing transiently until its attempts or time budget ran out.

    Final: ``node.daemon.retry.retry`` re-raises it at once, so nested retries never multiply.
    """


class Refused(SparseLoCoError, RuntimeError):
    """The coordinator refused this node for good (a revoked or unknown token, another live
    process holding the token); waiting will not help, the message says what will."""


class ResyncError(SparseLoCoError, RuntimeError):
    """θ diverged at the same round (or earlier) right after each of several resyncs in a row:
    the node cannot follow its peers, and says so instead of resynchronising forever."""


class DeviceError(SparseLoCoError, RuntimeError):
    """The training device asked for (``--device cuda:1``) is not there: no CUDA build of torch,
    no GPU visible, or fewer GPUs than the index; the message says what torch sees."""


class RanksError(SparseLoCoError, RuntimeError):
    """The processes of a multi-process node (torchrun) lost each other: one died or hung in a
    collective, or the setup cannot be split over them; the message names the phase."""


class StoreStartError(SparseLoCoError, RuntimeError):
    """The embedded object store could not be started (binary missing, exited, or never ready)."""


class UpError(SparseLoCoError, RuntimeError):
    """A part of the local run failed (a process exited early, a timeout passed)."""


class Abandoned(Exception):
    """Training stopped between inner steps because the node is shutting down."""
