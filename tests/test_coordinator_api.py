"""The coordinator's HTTP API in-process, against the real object store (SeaweedFS).

Each test builds a fresh app (its own state directory and key prefix) and drives it over HTTP
with the nodes' bearer tokens (``make_api``, ``tests/support/api.py``); payloads go to the store
through the presigned URLs exactly as a node sends them. Waiting is done with the manifest
long-poll, never with sleeps.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import pytest
from aiohttp import ClientSession
from yarl import URL

from node.cluster.seaweed import EmbeddedStore
from protocol.keys import manifest_key
from protocol.messages import CONDITION_HEADER, HEARD_HEADER, SignedManifest
from protocol.runconfig import RunConfig, Timing
from protocol.signing import verify_manifest
from support.api import FP_A, FP_B, FP_C, NODES, ApiFactory, token


def run_config(**kw: Any) -> RunConfig:
    return RunConfig(name="apitest", **kw)


@pytest.mark.asyncio
async def test_auth_and_validation_errors(make_api: ApiFactory) -> None:
    api = await make_api(run_config(), max_body_bytes=2048)
    status, body = await api.call("POST", "/v1/join", None, {})
    assert (status, body["error"]) == (401, "unauthorized")
    resp = await api.client.post("/v1/join", json={}, headers={"Authorization": "Bearer nope"})
    assert resp.status == 401
    status, body = await api.call("POST", "/v1/join", "n0", data=b"{not json")
    assert (status, body["error"]) == (400, "bad_json")
    status, body = await api.call("POST", "/v1/join", "n0", {"client": "x", "extra": 1})
    assert (status, body["error"], body["field"]) == (422, "invalid", "extra")
    status, body = await api.call("POST", "/v1/join", "n0", {"client": "x" * 4000})
    assert (status, body["error"]) == (413, "too_large")
    status, joined = await api.call("POST", "/v1/join", "n0", {"client": "test"})
    assert status == 200 and joined["node_id"] == "n0" and joined["slot"] == 0
    status, body = await api.call(
        "POST", "/v1/rounds/0/upload", "n0", {"size": 10, "sha256": "XYZ"}
    )
    assert (status, body["field"]) == (422, "sha256")
    too_big = api.config.storage.max_payload_bytes + 1
    status, body = await api.call(
        "POST", "/v1/rounds/0/upload", "n0", {"size": too_big, "sha256": "0" * 64}
    )
    assert (status, body["field"]) == (413, "size")
    status, body = await api.call(
        "POST", "/v1/rounds/5/upload", "n0", {"size": 1, "sha256": "0" * 64}
    )
    assert (status, body["error"]) == (404, "unknown_round")
    status, body = await api.call("GET", "/v1/rounds/7/manifest", "n0")
    assert (status, body["error"]) == (404, "unknown_round")
    status, body = await api.call("GET", "/v1/status?rounds=-3", None)
    assert (status, body["field"]) == (422, "rounds")
    status, body = await api.call("GET", "/v1/nowhere", None)
    assert (status, body["error"]) == (404, "not_found")
    status, body = await api.call("POST", "/v1/rounds/0/report", "n0", {"fingerprint": FP_A})
    assert (status, body["error"]) == (409, "round_open")


@pytest.mark.asyncio
async def test_full_round_with_presigned_upload(make_api: ApiFactory, store: EmbeddedStore) -> None:
    api = await make_api(run_config(min_nodes=2, gather_size=4, rounds=5))
    status, j0 = await api.call("POST", "/v1/join", "n0", {})
    assert j0["round"]["state"] == "waiting" and j0["round"]["expected"] is False
    status, j1 = await api.call("POST", "/v1/join", "n1", {})
    assert j1["slot"] == 1 and j1["round"]["state"] == "open" and j1["round"]["expected"]

    body = b"n0 payload for round 0" * 10
    assert await api.put_payload("n0", 0, b"X" * len(body), claimed=body) in (400, 403)
    assert await api.put_payload("n0", 0, body, claimed=body) == 200
    assert await api.put_payload("n0", 0, body, claimed=body) == 412  # write-once
    status, first = await api.submit("n0", 0, body, FP_A)
    assert (status, first) == (200, {"accepted": True, "reason": None})
    assert await api.submit("n0", 0, body, FP_A) == (200, first)  # a retry: same answer
    status, err = await api.submit("n0", 0, body + b"!", FP_A)
    assert (status, err["error"]) == (409, "already_submitted")
    status, pending = await api.manifest("n0", 0, wait=0)
    assert status == 202 and pending["submitted"] is True

    # A node joining now missed part of round 0: it starts with round 1.
    status, j2 = await api.call("POST", "/v1/join", "n2", {})
    assert j2["round"]["expected"] is False
    status, err = await api.call(
        "POST", "/v1/rounds/0/upload", "n2", {"size": 3, "sha256": "0" * 64}
    )
    assert (status, err["error"]) == (409, "not_expected")

    # n1 claims a payload it never uploaded: rejected as a bad digest; the round closes.
    status, resp = await api.submit("n1", 0, b"never uploaded", FP_A)
    assert resp == {"accepted": False, "reason": "bad digest"}
    status, view = await api.manifest("n2", 0)
    assert status == 200
    signed = SignedManifest.model_validate(view["signed"])
    verify_manifest(signed, j0["manifest_public_key"])  # raises ManifestError if not
    manifest = signed.manifest
    assert [e.node_id for e in manifest.gather] == ["n0"]
    assert manifest.excluded == {"n1": "bad digest"}
    assert manifest.base_fingerprint == FP_A
    assert manifest.gather[0].sha256 == hashlib.sha256(body).hexdigest()
    async with ClientSession() as http, http.get(URL(view["urls"]["n0"], encoded=True)) as r:
        assert await r.read() == body

    # The stored manifest object equals the signed one (published in the background).
    s3 = store.client()
    key = manifest_key(api.config.storage.prefix, api.config.run.run_id, 0)
    await asyncio.wait_for(api.coord.publisher.published.wait(), 30)
    stored = s3.get_object(Bucket=store.bucket, Key=key)["Body"].read()
    assert SignedManifest.model_validate_json(stored) == signed

    status, err = await api.submit("n0", 1, body, FP_A)  # nothing uploaded for round 1 yet
    assert status == 200 and err["reason"] == "bad digest"
    status, err = await api.call(
        "POST", "/v1/rounds/0/upload", "n0", {"size": 1, "sha256": "0" * 64}
    )
    assert (status, err["error"]) == (409, "round_closed")
    status, view = await api.call("POST", "/v1/rounds/0/report", "n1", {"fingerprint": FP_B})
    # The answer is the node's next question answered: the round as it now sees it.
    assert status == 200 and (view["round"], view["state"], view["expected"]) == (1, "open", True)
    status, st = await api.call("GET", "/v1/status", None)
    assert st["rounds"][0]["gather"] == ["n0"] and st["rounds"][0]["fingerprints"] == {"n1": FP_B}
    assert st["rounds"][1]["state"] == "open"
    assert [m["node_id"] for m in st["members"]] == ["n0", "n1", "n2"]


@pytest.mark.asyncio
async def test_deadline_closes_round_with_missed_deadline(make_api: ApiFactory) -> None:
    timing = Timing(first_round_s=1.0, min_round_s=1.0, margin_s=0.0, max_round_s=2.0)
    api = await make_api(run_config(min_nodes=2, timing=timing))
    await api.call("POST", "/v1/join", "n0", {})
    await api.call("POST", "/v1/join", "n1", {})
    assert (await api.contribute("n0", 0, FP_A))["accepted"]
    status, view = await api.manifest("n0", 0, wait=30)
    assert status == 200
    assert view["signed"]["manifest"]["excluded"] == {"n1": "missed deadline"}
    assert [e["node_id"] for e in view["signed"]["manifest"]["gather"]] == ["n0"]


@pytest.mark.asyncio
async def test_wrong_base_fingerprint_is_excluded(make_api: ApiFactory) -> None:
    api = await make_api(run_config(min_nodes=3))
    for n in NODES:
        await api.call("POST", "/v1/join", n, {})
    # Round 0: no reports yet, so the majority of the submissions sets the base.
    await api.contribute("n0", 0, FP_A)
    await api.contribute("n1", 0, FP_B)
    await api.contribute("n2", 0, FP_A)
    _status, view = await api.manifest("n0", 0)
    assert view["signed"]["manifest"]["excluded"] == {"n1": "wrong base fingerprint"}
    assert view["signed"]["manifest"]["base_fingerprint"] == FP_A
    # Reports for round 0 settle round 1's base: a different one is rejected on arrival.
    for n, fp in (("n0", FP_C), ("n1", FP_B), ("n2", FP_C)):
        await api.call("POST", "/v1/rounds/0/report", n, {"fingerprint": fp})
    assert (await api.contribute("n1", 1, FP_B)) == {
        "accepted": False,
        "reason": "wrong base fingerprint",
    }
    assert (await api.contribute("n0", 1, FP_C))["accepted"]


@pytest.mark.asyncio
async def test_over_limit_with_gather_size_one(make_api: ApiFactory) -> None:
    api = await make_api(run_config(min_nodes=2, gather_size=1))
    await api.call("POST", "/v1/join", "n0", {})
    await api.call("POST", "/v1/join", "n1", {})
    await api.contribute("n1", 0, FP_A)
    await api.contribute("n0", 0, FP_A)
    _status, view = await api.manifest("n0", 0)
    manifest = view["signed"]["manifest"]
    assert [e["node_id"] for e in manifest["gather"]] == ["n1"]  # first come, first gathered
    assert manifest["excluded"] == {"n0": "over limit"}


@pytest.mark.asyncio
async def test_leave_closes_the_round(make_api: ApiFactory) -> None:
    api = await make_api(run_config(min_nodes=2))
    await api.call("POST", "/v1/join", "n0", {})
    await api.call("POST", "/v1/join", "n1", {})
    await api.contribute("n0", 0, FP_A)
    status, _ack = await api.call("POST", "/v1/leave", "n1")
    assert status == 200
    # The close follows once n0's payload is confirmed (one listing): the long-poll sees it.
    status, view = await api.manifest("n0", 0)
    assert status == 200 and view["signed"]["manifest"]["excluded"] == {"n1": "left"}
    status, err = await api.call("POST", "/v1/heartbeat", "n1")
    assert (status, err["error"]) == (409, "not_member")
    status, rejoined = await api.call("POST", "/v1/join", "n1", {})
    assert rejoined["slot"] == 1 and rejoined["round"]["round"] == 1
    assert rejoined["round"]["expected"] is True  # round 1 had no submission yet
    status, hb = await api.call("POST", "/v1/heartbeat", "n1")
    assert status == 200 and hb["round"] == 1


@pytest.mark.asyncio
async def test_run_finishes_after_its_rounds(make_api: ApiFactory) -> None:
    api = await make_api(run_config(rounds=2))
    await api.call("POST", "/v1/join", "n0", {})
    for r in range(2):
        assert (await api.contribute("n0", r, FP_A))["accepted"]
        assert (await api.manifest("n0", r))[0] == 200
    status, view = await api.call("GET", "/v1/round", "n0")
    assert view["state"] == "finished" and view["round"] == 2 and view["last_closed"] == 1
    status, err = await api.manifest("n0", 2, wait=0)
    assert (status, err["error"]) == (404, "unknown_round")
    status, err = await api.call(
        "POST", "/v1/rounds/1/upload", "n0", {"size": 1, "sha256": "0" * 64}
    )
    assert (status, err["error"]) == (409, "round_closed")
    status, st = await api.call("GET", "/v1/status", None)
    assert st["state"] == "finished" and [r["round"] for r in st["rounds"]] == [0, 1]


@pytest.mark.asyncio
async def test_openapi_lists_every_route_and_metrics_count(make_api: ApiFactory) -> None:
    api = await make_api(run_config())
    status, doc = await api.call("GET", "/openapi.json", None)
    assert status == 200 and doc["openapi"].startswith("3.1")
    routes = {
        (r.method, r.resource.canonical.replace("{round:\\d{1,18}}", "{round}"))
        for r in api.client.app.router.routes()
        if r.resource is not None and r.method != "HEAD"
    }
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented
    await api.call("POST", "/v1/join", "n0", {})
    await api.contribute("n0", 0, FP_A)
    assert (await api.manifest("n0", 0))[0] == 200
    status, text = await api.call("GET", "/metrics", None)
    assert "sparseloco_rounds_closed_total 1.0" in text
    assert 'sparseloco_members{state="active"} 1.0' in text
    assert 'sparseloco_submissions_total{result="accepted"} 1.0' in text


@pytest.mark.asyncio
async def test_heartbeat_timeout_is_enforced(make_api: ApiFactory) -> None:
    timing = Timing(heartbeat_timeout_s=0.5)
    api = await make_api(run_config(min_nodes=2, timing=timing))
    await api.call("POST", "/v1/join", "n0", {})
    await api.call("POST", "/v1/join", "n1", {})
    await api.contribute("n0", 0, FP_A)
    # n1 never heartbeats; keep n0 alive while the round waits for the timeout to close it.
    deadline = time.monotonic() + 30
    status = 202
    while status == 202 and time.monotonic() < deadline:
        await api.call("POST", "/v1/heartbeat", "n0")
        status, view = await api.manifest("n0", 0, wait=0.1)
    assert status == 200
    assert view["signed"]["manifest"]["excluded"] == {"n1": "timed out"}


@pytest.mark.asyncio
async def test_a_request_that_says_the_condition_counts_as_a_heartbeat(
    make_api: ApiFactory,
) -> None:
    """Any request of an active member carrying ``X-Sparseloco-Condition`` keeps it alive and
    says what it does; the answer names what the coordinator now holds (``X-Sparseloco-Heard``),
    ``training`` once it hands out a manifest. A non-member's request is served without being
    counted; a malformed condition is a 422 naming the header."""
    timing = Timing(heartbeat_timeout_s=1.5)
    api = await make_api(run_config(min_nodes=2, timing=timing))
    await api.call("POST", "/v1/join", "n0", {})
    await api.call("POST", "/v1/join", "n1", {})

    async def said(node: str, method: str, path: str, condition: str, **kw: Any) -> Any:
        headers = {"Authorization": f"Bearer {token(node)}", CONDITION_HEADER: condition}
        return await api.client.request(method, path, headers=headers, **kw)

    resp = await said("n0", "GET", "/v1/rounds/0/manifest", "dozing")
    assert resp.status == 422 and (await resp.json())["field"] == CONDITION_HEADER
    resp = await said("n2", "GET", "/v1/status", "training")  # not a member: served, not heard
    assert resp.status == 200 and HEARD_HEADER not in resp.headers

    # Three heartbeat timeouts pass; n0 never beats, only asks for the round and says so.
    await api.contribute("n0", 0, FP_A)
    for _ in range(9):
        resp = await said("n0", "GET", "/v1/round", "waiting")
        assert resp.headers[HEARD_HEADER] == "waiting"
        await api.call("POST", "/v1/heartbeat", "n1")
        await asyncio.sleep(0.5)
    members = {m["node_id"]: m for m in (await api.call("GET", "/v1/status", None))[1]["members"]}
    assert members["n0"]["state"] == "active" and members["n0"]["condition"] == "waiting"

    await api.contribute("n1", 0, FP_A)
    resp = await said("n0", "GET", "/v1/rounds/0/manifest?wait=10", "waiting")
    assert resp.status == 200 and resp.headers[HEARD_HEADER] == "training"
    members = {m["node_id"]: m for m in (await api.call("GET", "/v1/status", None))[1]["members"]}
    assert members["n0"]["condition"] == "training"
