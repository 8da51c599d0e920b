"""Shared fixtures: a real S3-compatible object store (SeaweedFS ``weed mini``) for the session,
and moto's S3 server and MiniStack as other implementations for the tests that name them
(``moto``, ``ministack``).

Tests that touch storage use this one store and keep apart by key prefix (one per test), so the
few seconds the store takes to start are paid once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from node.cluster.seaweed import EmbeddedStore
from support.s3servers import MiniStackStore, MotoStore

#: Fixture modules of ``tests/support`` every test may use: ``make_api`` (the coordinator's API
#: in-process on this store); and the session's plugins: ``reaper`` (SIGTERM tears down like
#: Ctrl-C, and no process outlives the session), ``ordering`` (in-process tests first, a line per
#: file under ``-q``).
pytest_plugins = [
    "support.reaper",
    "support.ordering",
    "support.api",
    "support.browser",
    "support.daemon_harness",
]


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStore]:
    """A started ``EmbeddedStore`` (its ``.endpoint`` has the URL, bucket and credentials)."""
    embedded = EmbeddedStore(tmp_path_factory.mktemp("store"))
    embedded.start()
    try:
        yield embedded
    finally:
        embedded.stop()


@pytest.fixture(scope="session")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoStore]:
    """moto's S3 server, started (a second S3 implementation: ``support.s3servers``)."""
    server = MotoStore(tmp_path_factory.mktemp("moto"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def ministack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MiniStackStore]:
    """MiniStack, started (a third S3 implementation, in a virtual environment of its own:
    ``support.s3servers``)."""
    server = MiniStackStore(tmp_path_factory.mktemp("ministack"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3(store: EmbeddedStore) -> Any:
    """A boto3 S3 client with the store's admin credentials."""
    return store.client()
