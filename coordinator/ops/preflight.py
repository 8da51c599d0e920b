"""Checks before the coordinator writes anything: the port it will listen on, and the store.

``coordinator.ops.server.serve`` runs them first, in this order, so a mistake costs one clear line
and leaves no state directory, database or signing key behind:

1. ``listen_socket`` binds the configured host and port at once; the server later serves on
   this very socket, so nothing can take the port in between. A port in use, an address this
   machine does not have, or a privileged port is a one-line ``StartupError``. A host name that
   resolves to several addresses listens on the first one (name an address to choose).
2. ``check_store`` HEADs the bucket, then writes and deletes a small object under the run's
   prefix: the endpoint, the credentials, the bucket and the right to write and delete are
   proven before any node is told to upload. Each failure is named (unreachable, credentials,
   no bucket, no permission) with the config field that fixes it, and carries no secret.
3. ``adopt_promises`` tries every promise the project relies on (``coordinator.store.conformance``,
   what ``sparseloco store check`` prints): where the store misses one the project can do
   without, the store is used the other way and a WARNING line says so, one per fallback; where
   it cannot, a ``StartupError`` names what is missing and what to use instead.
"""

from __future__ import annotations

import errno
import logging
import socket
import uuid

from coordinator.base.config import StorageConfig
from coordinator.base.errors import StartupError, StorageError
from coordinator.store.conformance import check_promises
from coordinator.store.promises import StoreProfile
from coordinator.store.storage import S3Store
from protocol.keys import run_prefix

log = logging.getLogger("sparseloco.coordinator.preflight")

#: Store error codes that mean "these credentials are not accepted here".
CREDENTIAL_CODES = frozenset(
    {
        "403",
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "InvalidClientTokenId",
        "ExpiredToken",
    }
)
#: Store error codes that mean "no such bucket".
NO_BUCKET_CODES = frozenset({"404", "NoSuchBucket"})
#: Store error codes that mean "this bucket lives in another region".
REGION_CODES = frozenset({"301", "PermanentRedirect", "AuthorizationHeaderMalformed"})
CREDENTIAL_FIELDS = (
    "storage.access_key and storage.secret_key (or SPARSELOCO_COORD_STORAGE__ACCESS_KEY and"
    " SPARSELOCO_COORD_STORAGE__SECRET_KEY)"
)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0: any free one), not yet listening."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise StartupError(
            f"cannot listen on {host!r}: the name does not resolve ({exc.strerror});"
            " fix server.host or --host"
        ) from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As asyncio does: a restart can take the port while old connections linger in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise StartupError(_bind_problem(host, port, exc)) from exc
    return sock


def _bind_problem(host: str, port: int, exc: OSError) -> str:
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use (another coordinator?); stop that process,"
            " or choose another port with --port or server.port"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"cannot listen on {where}: {host} is not an address of this machine; fix"
            " server.host or --host (0.0.0.0 listens on all of them)"
        )
    if exc.errno == errno.EACCES:
        return (
            f"cannot listen on {where}: permission denied (ports below 1024 need privileges);"
            " choose a port above 1023"
        )
    return f"cannot listen on {where}: {exc.strerror or exc}"


async def check_store(store: S3Store, *, endpoint: str, prefix: str, run_id: str) -> None:
    """Prove the store works for this run, or raise ``StartupError`` saying what to fix."""
    log.info("event=checking_store endpoint=%s bucket=%s", endpoint, store.bucket)
    key = f"{run_prefix(prefix, run_id)}startup-check-{uuid.uuid4().hex[:12]}.json"
    step = "head bucket"
    try:
        await store.check_bucket()
        step = f"write {key}"
        await store.put_bytes(key, b'{"check": "coordinator start"}')
        step = f"delete {key}"
        await store.delete_keys([key])
    except StorageError as exc:
        raise StartupError(store_problem(exc, step, endpoint, store.bucket)) from exc
    log.info("event=store_ok endpoint=%s bucket=%s", endpoint, store.bucket)


async def adopt_promises(store: S3Store, storage: StorageConfig, *, run_id: str) -> StoreProfile:
    """Try the store's promises under the run's prefix and work with what it keeps; a
    ``StartupError`` where the project cannot run on it."""
    try:
        report = await check_promises(store, run_prefix(storage.prefix, run_id))
    except StorageError as exc:
        raise StartupError(
            f"the object store at {storage.endpoint_url} failed the store check: {exc.code}:"
            f" {exc}; `sparseloco store check --config FILE` shows each step"
        ) from exc
    profile = report.profile
    accept = storage.accept_unbound_uploads
    problems = profile.problems(accept_unbound=accept)
    if problems:
        missing = [f.promise for f in report.findings if f.kept is False]
        raise StartupError(
            f"the object store at {storage.endpoint_url} cannot carry this run: "
            + "; ".join(problems)
            + f" (promises not kept: {', '.join(missing)}; `sparseloco store check --config FILE`"
            " prints the whole table)"
        )
    for line in profile.fallbacks(accept_unbound=accept):
        log.warning("event=store_fallback what=%r", line)
    kept = sum(f.kept is True for f in report.findings)
    log.info("event=store_promises kept=%d of=%d", kept, len(report.findings))
    store.adopt(profile)
    return profile


def store_problem(exc: StorageError, step: str, endpoint: str, bucket: str) -> str:
    """One line: which check failed, what it means, and which setting fixes it."""
    code = exc.code
    if code is None:
        return (
            f"cannot reach the object store at {endpoint} ({exc}); check storage.endpoint_url"
            " and that the store is running and reachable from here"
        )
    if code in NO_BUCKET_CODES and step == "head bucket":
        return (
            f"bucket {bucket!r} does not exist at {endpoint}; create it (deploy/README.md) or"
            " fix storage.bucket"
        )
    if code in REGION_CODES:
        return (
            f"the object store at {endpoint} says bucket {bucket!r} is in another region"
            f" ({code}); fix storage.region"
        )
    if code in CREDENTIAL_CODES:
        if step == "head bucket" or code != "AccessDenied":
            return (
                f"the object store at {endpoint} refused the credentials for bucket {bucket!r}"
                f" ({code}); check {CREDENTIAL_FIELDS}"
            )
        return (
            f"the credentials may read bucket {bucket!r} but not {step.split()[0]} in it"
            f" ({code}); the coordinator needs to write and delete under storage.prefix"
        )
    return f"the object store at {endpoint} failed the start-up check ({step}): {code}: {exc}"
