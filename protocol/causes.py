"""Why a request failed, in a few words a person reads: ``cause(exc)``.

Log lines and ``doctor`` name what went wrong ("connection refused by 127.0.0.1:8333",
"HTTP 503", "timed out") instead of printing an exception's ``repr``: those run to hundreds of
characters (aiohttp's ``ClientConnectorError(ConnectionKey(host=..., ssl=True, proxy=None, ...``)
and say the same thing less clearly. The repr stays available at DEBUG, where the callers log it.

Library exceptions are recognised by their attributes, not imported, so this module stays pure
(both the node's aiohttp and the coordinator's botocore errors pass through it). A library's own
text is used only where it cannot carry a presigned URL: such a URL holds a signature that
grants access until it expires, and ``str()`` of an HTTP response error includes it. An
exception it does not know is named by its type.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from protocol.errors import SparseLoCoError

#: Longest cause returned; a log line stays readable on one screen line with it.
MAX_CAUSE = 120

#: Exceptions whose own message is safe and already says what happened, by type name.
_PHRASES = {
    "ServerDisconnectedError": "the server closed the connection",
    "ClientPayloadError": "the response broke off",
    "ConnectionResetError": "connection reset",
    "BrokenPipeError": "connection closed while sending",
    "ConnectionRefusedError": "connection refused",
    "ReadTimeoutError": "timed out waiting for the answer",
    "ConnectTimeoutError": "timed out connecting",
    "ServerTimeoutError": "timed out",
    "ConnectionTimeoutError": "timed out connecting",
    "SocketTimeoutError": "timed out waiting for the answer",
}


def cause(exc: BaseException, *, limit: int = MAX_CAUSE) -> str:
    """A short, human cause for ``exc`` (no repr, no URL query), at most ``limit`` characters."""
    text = _cause(exc, depth=0)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cause(exc: BaseException, depth: int) -> str:
    inner = exc.__cause__
    name = type(exc).__name__
    # A wrapper of ours around the real failure (retries used up): the failure is the cause.
    if name == "RetriesExhausted" and inner is not None and depth < 5:
        return _cause(inner, depth + 1)
    connect = _connect_cause(exc)
    if connect is not None:
        return connect
    if name in _PHRASES:
        return _PHRASES[name]
    if isinstance(exc, TimeoutError):
        return "timed out"
    if _is_ours(exc):
        status, error = getattr(exc, "status", None), getattr(exc, "error", None)
        if name == "TransientError" and isinstance(status, int):
            # The request is said elsewhere; the body (an S3 error's XML) is not for people.
            return f"HTTP {status} {error}" if error else f"HTTP {status}"
        return str(exc) or name
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return f"HTTP {status}"  # aiohttp's ClientResponseError: its text holds the URL
    if name == "EndpointConnectionError":  # botocore: the store's address did not answer
        url = str(getattr(exc, "kwargs", {}).get("endpoint_url", ""))
        return f"cannot connect to {urlsplit(url).netloc or 'the store'}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    if inner is not None and depth < 5:
        return _cause(inner, depth + 1)
    return name


def _connect_cause(exc: BaseException) -> str | None:
    """aiohttp's ClientConnectorError carries ``host``, ``port`` and the ``os_error``."""
    os_error = getattr(exc, "os_error", None)
    host, port = getattr(exc, "host", None), getattr(exc, "port", None)
    if not isinstance(os_error, OSError) or host is None:
        return None
    where = f"{host}:{port}" if port else str(host)
    if isinstance(os_error, ConnectionRefusedError):
        return f"connection refused by {where}"
    if isinstance(os_error, socket.gaierror):
        return f"cannot resolve the host name {host}"
    if isinstance(os_error, TimeoutError):
        return f"timed out connecting to {where}"
    reason = (os_error.strerror or type(os_error).__name__).lower()
    return f"cannot connect to {where} ({reason})"


def _is_ours(exc: BaseException) -> bool:
    """One of the project's errors: its message is written for people."""
    return isinstance(exc, SparseLoCoError)
