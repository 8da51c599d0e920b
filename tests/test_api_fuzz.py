"""API fuzzing: schemathesis holds the coordinator to its own OpenAPI document.

A real coordinator app serves on a loopback port (in a thread of this process, on the session's
SeaweedFS store), with one closed round, a report and a member behind it so the authenticated
paths have state to act on. schemathesis loads the live ``/openapi.json`` and, for every
operation, generates requests that fit the document (positive) and requests that break it
(negative: wrong types, out-of-range numbers, missing fields, bad path and query values), sent
with a valid bearer token. Every response must pass the checks: no 5xx; the status is one the
document declares for the operation; the content type and the body conform to the declared
response schema, declared headers to theirs; negative data is refused with a 4xx.

The examples per operation and mode are bounded (``EXAMPLES``) and derandomised, so the run is
the same every time and stays well under a minute. A failure lists the operation, the request
and what did not conform.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import requests
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.result import Err

from coordinator.api.app import create_app
from coordinator.base.config import CoordinatorConfig
from coordinator.base.limits import server_settings
from node.cluster.seaweed import EmbeddedStore
from node.tools.shards import prepare as prepare_dataset
from node.tools.shards import upload
from protocol.runconfig import RunConfig, Timing
from support.api import FP_A, make_config, token

#: Generated requests per operation, generation mode and round (see ``fuzz``).
EXAMPLES = 40
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
]
RUN = RunConfig(
    name="fuzz",
    rounds=1000,
    min_nodes=2,
    checkpoint_every=2,
    timing=Timing(first_round_s=600, min_round_s=600, max_round_s=600, heartbeat_timeout_s=600),
)
AUTH = {"Authorization": f"Bearer {token('n0')}"}


class LiveCoordinator:
    """The coordinator app on a loopback port, served from its own event loop in a thread."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="coordinator")
        self.runner: web.AppRunner | None = None
        self.url = ""

    def __enter__(self) -> LiveCoordinator:
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)
        return self

    async def _start(self) -> str:
        app = create_app(self.config)
        self.runner = web.AppRunner(app, access_log=None, **server_settings(self.config.limits))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def __exit__(self, *exc: object) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def prepare(url: str) -> None:
    """n0 and n1 join and contribute to round 0, which closes; n0 reports it. Round 1 stays
    open (its deadline is minutes away) while the fuzzer works."""
    sessions = {node: requests.Session() for node in ("n0", "n1")}
    for node, http in sessions.items():
        http.headers["Authorization"] = f"Bearer {token(node)}"
        assert http.post(f"{url}/v1/join", json={}).status_code == 200
    for node, http in sessions.items():
        body = f"{node}'s payload of round 0".encode()
        digest = hashlib.sha256(body).hexdigest()
        grant = http.post(f"{url}/v1/rounds/0/upload", json={"size": len(body), "sha256": digest})
        assert grant.status_code == 200, grant.text
        put = requests.put(grant.json()["url"], data=body, headers=grant.json()["headers"])
        assert put.status_code == 200, put.text
        sub: dict[str, Any] = {"size": len(body), "sha256": digest, "base_fingerprint": FP_A}
        assert http.post(f"{url}/v1/rounds/0/submit", json=sub).json()["accepted"]
    http.headers.update(AUTH)
    assert http.get(f"{url}/v1/rounds/0/manifest?wait=10").status_code == 200
    assert http.post(f"{url}/v1/rounds/0/report", json={"fingerprint": FP_A}).status_code == 200


@pytest.fixture
def live(store: EmbeddedStore, tmp_path: Path) -> Iterator[str]:
    # The run names a dataset, so the dataset endpoints have files to presign (and refuse).
    prefix = f"fuzz-{uuid.uuid4().hex[:8]}"
    corpus = Path(__file__).parent.parent / "node" / "corpus" / "tempest_gut.txt"
    dataset = prepare_dataset([str(corpus)], tmp_path / "data", shard_tokens=4000)
    e = store.endpoint
    upload(
        tmp_path / "data", dataset, endpoint=e.endpoint_url, bucket=e.bucket, prefix=prefix,
        credentials=(e.access_key, e.secret_key),
    )  # fmt: skip
    config = make_config(
        store,
        tmp_path / "state",
        RUN.model_copy(update={"dataset": dataset.dataset_id}),
        prefix=prefix,
        manifest_wait_max_s=0.2,  # an open round's long-poll must not stall the run
        # One client sends everything, far faster than any node: the rates are not under test.
        auth_failures_burst=1_000_000,
        node_requests_burst=1_000_000,
    )
    with LiveCoordinator(config) as server:
        prepare(server.url)
        yield server.url


class Tally:
    """What the fuzzing did: operations, examples, statuses seen, and every failed check."""

    def __init__(self) -> None:
        self.operations = 0
        self.examples = 0
        self.statuses: dict[int, int] = {}
        self.failures: list[str] = []
        #: (operation, mode) with no request to generate (no negative form of "no parameters").
        self.unsatisfiable: list[str] = []


def _invalid_on_the_wire(operation: Any, response: Any) -> bool:
    """Whether a "negative" request still broke the document once it was sent.

    Some mutations do not survive the trip: a missing Authorization header is put back by this
    harness (every request carries a valid token, so the generated request is judged on the
    rest), and requests drops a query parameter whose value is an empty list, so an "unknown
    parameter" may never reach the server. When what was sent has only declared query
    parameters, each a number inside its declared range, path parameters that are plain
    integers, and no body, it is a valid request, and answering it is right; schemathesis's
    check would call that a failure."""
    sent = response.request
    if sent.body:
        return True
    declared = {
        p["name"]: p["schema"]
        for p in operation.definition.raw.get("parameters", [])
        if p.get("in") == "query"
    }
    for name, values in parse_qs(urlsplit(str(sent.url)).query, keep_blank_values=True).items():
        schema = declared.get(name)
        if schema is None or len(values) != 1:
            return True
        try:
            value = float(values[0])
        except ValueError:
            return True
        if not schema["minimum"] <= value <= schema["maximum"]:
            return True
        if schema["type"] == "integer" and not re.fullmatch(r"[0-9]+", values[0]):
            return True
    # Path parameters (rounds) must be plain non-negative integers too.
    template = re.sub(r"\\{[a-z_]+\\}", "[0-9]+", re.escape(operation.path))
    return re.fullmatch(template, urlsplit(str(sent.url)).path) is None


def fuzz(
    operation: Any,
    mode: GenerationMode,
    url: str,
    http: requests.Session,
    tally: Tally,
    round_: int | None = None,
) -> None:
    """``EXAMPLES`` generated requests of ``mode`` against ``operation``, each checked;
    ``round_`` pins the round in the path (else it is generated too)."""
    pinned = {} if round_ is None else {"path_parameters": {"round": round_}}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode, **pinned))
    def exercise(case: schemathesis.Case) -> None:
        # Every request starts from the same standing: n0 an active member bound to no process
        # in particular (a generated join or leave may have changed it), so the generated
        # request is judged on its own, not refused for what the one before it did.
        assert http.post(f"{url}/v1/join", json={}, headers=AUTH, timeout=30).status_code == 200
        response = case.call(base_url=url, session=http, headers=AUTH, timeout=30)
        tally.examples += 1
        tally.statuses[response.status_code] = tally.statuses.get(response.status_code, 0) + 1
        checks = CHECKS
        if mode == GenerationMode.NEGATIVE and not _invalid_on_the_wire(operation, response):
            checks = [c for c in CHECKS if c is not negative_data_rejection]
        try:
            case.validate_response(response, checks=checks, headers=AUTH)
        except (AssertionError, BaseExceptionGroup) as exc:
            curl = case.as_curl_command()
            tally.failures.append(f"{operation.label} [{mode.value}] {curl}\n{exc}")

    try:
        exercise()
    except Unsatisfiable:
        tally.unsatisfiable.append(f"{operation.label} [{mode.value}]")


def test_the_api_conforms_to_its_openapi_document(live: str, capsys: Any) -> None:
    doc = requests.get(f"{live}/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(doc)
    http = requests.Session()
    tally = Tally()
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            pytest.fail(f"schemathesis cannot read an operation of the document: {result.err()}")
        operation = result.ok()
        tally.operations += 1
        # A generated round is almost never one that exists: the bodies of round operations are
        # also fuzzed on round 0 (closed, reported) and round 1 (open).
        pins = [None, 0, 1] if "{round}" in operation.path else [None]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for round_ in pins:
                fuzz(operation, mode, live, http, tally, round_)
    elapsed = time.monotonic() - t0
    with capsys.disabled():
        print(
            f"\napi fuzz: {tally.operations} operations, {tally.examples} examples,"
            f" {len(tally.failures)} failures in {elapsed:.1f} s;"
            f" nothing to generate for {tally.unsatisfiable};"
            f" statuses {dict(sorted(tally.statuses.items()))}"
        )
    assert tally.operations == sum(len(ops) for ops in doc["paths"].values())
    assert not tally.failures, f"{len(tally.failures)} failures:\n" + "\n\n".join(
        tally.failures[:15]
    )
