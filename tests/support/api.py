"""The coordinator's HTTP API in-process: one fixture, ``make_api``, and the ``Api`` it returns.

``await make_api(run, ...)`` builds a coordinator app on the session's SeaweedFS store, starts it
on a test server and hands back an ``Api`` that speaks as any node of ``NODES`` (each has its
bearer token). Payloads travel through the presigned URLs exactly as a node sends them. Every
client the fixture started is closed when the test ends.

Registered for every test module by ``tests/conftest.py`` (``pytest_plugins``).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest_asyncio
from aiohttp import ClientSession
from aiohttp.test_utils import TestClient, TestServer
from yarl import URL

from coordinator.api.app import create_app
from coordinator.api.service import COORDINATOR, Coordinator
from coordinator.base.config import CoordinatorConfig, ServerConfig, StorageConfig, load_config
from coordinator.base.limits import LimitsConfig, server_settings
from coordinator.store.object_store import ObjectStore
from node.cluster.seaweed import EmbeddedStore, StoreEndpoint
from protocol.runconfig import RunConfig

#: Fingerprints of θ that tests hand around (any 32 hex digits do).
FP_A = "a" * 32
FP_B = "b" * 32
FP_C = "c" * 32
#: The nodes allowed to join (each has a token in the config).
NODES = ("n0", "n1", "n2")


def token(node: str) -> str:
    """The bearer token of ``node`` in every config ``make_config`` writes."""
    return f"token-of-{node}-0123456789"


def make_config(
    store: EmbeddedStore | StoreEndpoint,
    state_dir: Path,
    run: RunConfig,
    *,
    prefix: str,
    **fields: Any,
) -> CoordinatorConfig:
    """A config for ``run`` on ``store`` (or an endpoint) under key ``prefix``, with tokens for
    ``NODES``.

    ``fields`` are keys of the ``[server]``, ``[storage]`` or ``[limits]`` section
    (``max_body_bytes=2048``, ``max_checkpoint_bytes=4096``, ``body_timeout_s=0.5``), each put
    in the section that has it.
    """
    e = store if isinstance(store, StoreEndpoint) else store.endpoint
    server: dict[str, Any] = {"state_dir": str(state_dir)}
    storage: dict[str, Any] = {
        "endpoint_url": e.endpoint_url,
        "bucket": e.bucket,
        "access_key": e.access_key,
        "secret_key": e.secret_key,
        "prefix": prefix,
    }
    limits: dict[str, Any] = {}
    for name, value in fields.items():
        if name in ServerConfig.model_fields:
            server[name] = value
        elif name in StorageConfig.model_fields:
            storage[name] = value
        elif name in LimitsConfig.model_fields:
            limits[name] = value
        else:
            raise TypeError(f"{name} is not a [server], [storage] or [limits] field")
    overrides = {
        "run": run.model_dump(mode="json"),
        "server": server,
        "storage": storage,
        "limits": limits,
        "tokens": {n: token(n) for n in NODES},
    }
    return load_config(None, overrides)


class Api:
    """The test client plus helpers that speak as a node."""

    def __init__(self, client: TestClient[Any, Any], config: CoordinatorConfig) -> None:
        self.client = client
        self.config = config

    @property
    def coord(self) -> Coordinator:
        return self.client.app[COORDINATOR]

    async def call(
        self, method: str, path: str, node: str | None, body: Any = None, **kw: Any
    ) -> tuple[int, Any]:
        headers = {} if node is None else {"Authorization": f"Bearer {token(node)}"}
        resp = await self.client.request(method, path, json=body, headers=headers, **kw)
        data = await resp.json() if resp.content_type == "application/json" else await resp.text()
        return resp.status, data

    async def put_payload(self, node: str, round_: int, body: bytes, *, claimed: bytes) -> int:
        """Ask for an upload grant for ``claimed`` and PUT ``body`` with it: the store's status."""
        status, grant = await self.call(
            "POST",
            f"/v1/rounds/{round_}/upload",
            node,
            {"size": len(claimed), "sha256": hashlib.sha256(claimed).hexdigest()},
        )
        assert status == 200, grant
        async with (
            ClientSession() as http,
            http.put(URL(grant["url"], encoded=True), data=body, headers=grant["headers"]) as r,
        ):
            return r.status

    async def contribute(
        self, node: str, round_: int, base: str, body: bytes | None = None
    ) -> dict[str, Any]:
        """Upload a payload and submit it; the submit response."""
        body = body or f"payload {node} {round_}".encode()
        assert await self.put_payload(node, round_, body, claimed=body) == 200
        status, resp = await self.submit(node, round_, body, base)
        assert status == 200, resp
        return dict(resp)

    async def submit(self, node: str, round_: int, body: bytes, base: str) -> tuple[int, Any]:
        req = {
            "size": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
            "base_fingerprint": base,
        }
        return await self.call("POST", f"/v1/rounds/{round_}/submit", node, req)

    async def manifest(self, node: str, round_: int, wait: float = 30) -> tuple[int, Any]:
        return await self.call("GET", f"/v1/rounds/{round_}/manifest?wait={wait}", node)


#: ``make_api``'s value: ``await make_api(run, ...)`` is a started ``Api``.
ApiFactory = Callable[..., Awaitable[Api]]


@pytest_asyncio.fixture
async def make_api(store: EmbeddedStore, tmp_path: Path) -> AsyncIterator[ApiFactory]:
    """``await make_api(run, state=..., prefix=..., clock=..., **fields)``: a started ``Api``.

    ``state`` names the state directory under ``tmp_path``: a second call with the same one is
    the coordinator restarted on its state. ``prefix`` defaults to a fresh key prefix per call;
    ``clock`` is the coordinator's wall clock; ``endpoint``: another store than the session's
    (``object_store``: the coordinator's store object itself, e.g. an ``S3Store`` that adopted
    a store check's profile); ``fields`` go to ``make_config``.
    """
    clients: list[TestClient[Any, Any]] = []

    async def factory(
        run: RunConfig,
        *,
        state: str = "state",
        prefix: str | None = None,
        clock: Callable[[], float] = time.time,
        endpoint: StoreEndpoint | None = None,
        object_store: ObjectStore | None = None,
        **fields: Any,
    ) -> Api:
        prefix = prefix or f"t-{uuid.uuid4().hex[:8]}"
        config = make_config(endpoint or store, tmp_path / state, run, prefix=prefix, **fields)
        server = TestServer(create_app(config, clock=clock, store=object_store))
        # The connection limits the real server runs with (``TestServer`` takes them here).
        await server.start_server(**server_settings(config.limits))
        client = TestClient(server)
        await client.start_server()
        clients.append(client)
        return Api(client, config)

    yield factory
    for client in clients:
        await client.close()
