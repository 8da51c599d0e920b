"""Submissions confirmed together before the round closes, against the real store (SeaweedFS).

A submission of the only payload the coordinator granted at its key is answered without a
HEAD; the round's close lists the round's folder once and rejects, as a bad digest, the ones
whose object is not there (``coordinator.rules.payloadchecks``, ``coordinator.api.confirm``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from coordinator.base.errors import StorageError
from protocol.messages import SignedManifest
from protocol.runconfig import RunConfig
from support.api import FP_A, Api, ApiFactory


def run_config(**kw: Any) -> RunConfig:
    return RunConfig(name="confirmtest", **kw)


def count_calls(api: Api, name: str) -> list[str]:
    """Wrap the coordinator store's method ``name``; the keys (or prefixes) it was called with."""
    store = api.coord.store
    inner: Callable[..., Awaitable[Any]] = getattr(store, name)
    seen: list[str] = []

    async def counted(arg: str, *rest: Any) -> Any:
        seen.append(arg)
        return await inner(arg, *rest)

    setattr(store, name, counted)
    return seen


async def closed_manifest(api: Api, round_: int) -> SignedManifest:
    status, view = await api.manifest("n0", round_, wait=10)
    assert status == 200, view
    return SignedManifest.model_validate(view["signed"])


@pytest.mark.asyncio
async def test_granted_submissions_are_answered_at_once_and_confirmed_at_the_close(
    make_api: ApiFactory,
) -> None:
    api = await make_api(run_config(min_nodes=3, gather_size=4, rounds=3))
    for node in ("n0", "n1", "n2"):
        assert (await api.call("POST", "/v1/join", node, {}))[0] == 200
    heads, listings = count_calls(api, "head"), count_calls(api, "sizes")

    good = b"n0's payload" * 20
    assert await api.put_payload("n0", 0, good, claimed=good) == 200
    assert await api.submit("n0", 0, good, FP_A) == (200, {"accepted": True, "reason": None})
    # n1 was granted an upload and never made it (the store refused other bytes): its
    # submission is answered as n0's was, and found out when the round closes.
    ghost = b"n1's payload" * 20
    assert await api.put_payload("n1", 0, b"Y" * len(ghost), claimed=ghost) in (400, 403)
    assert await api.submit("n1", 0, ghost, FP_A) == (200, {"accepted": True, "reason": None})
    assert heads == [] and listings == []  # no store request for either answer
    assert (await api.manifest("n0", 0, wait=0))[0] == 202  # n2 is still waited for

    # n2 asked for grants of two different payloads: its submission is HEADed at once.
    other = b"n2's first try" * 20
    final = b"n2's payload" * 20
    assert await api.put_payload("n2", 0, b"Z" * len(other), claimed=other) in (400, 403)
    assert await api.put_payload("n2", 0, final, claimed=final) == 200
    assert await api.submit("n2", 0, final, FP_A) == (200, {"accepted": True, "reason": None})
    manifest = (await closed_manifest(api, 0)).manifest
    assert [e.node_id for e in manifest.gather] == ["n0", "n2"]
    assert manifest.excluded == {"n1": "bad digest"}
    assert len(listings) == 1  # the whole round in one listing
    assert sorted(k.rsplit("/", 1)[-1] for k in heads) == [
        "n1.slc",
        "n2.slc",
    ]  # n1: looked at again
    # A retry of n1's submission now gets the verdict the close reached.
    assert await api.submit("n1", 0, ghost, FP_A) == (
        200,
        {"accepted": False, "reason": "bad digest"},
    )


@pytest.mark.asyncio
async def test_a_restarted_coordinator_confirms_the_open_rounds_submissions_again(
    make_api: ApiFactory,
) -> None:
    run = run_config(min_nodes=2, gather_size=4, rounds=3)
    api = await make_api(run)
    for node in ("n0", "n1"):
        assert (await api.call("POST", "/v1/join", node, {}))[0] == 200
    body = b"n0 before the restart" * 10
    assert await api.put_payload("n0", 0, body, claimed=body) == 200
    assert (await api.submit("n0", 0, body, FP_A))[1]["accepted"] is True
    await api.client.close()

    again = await make_api(run, prefix=api.config.storage.prefix)  # a restart on that state
    listings = count_calls(again, "sizes")
    later = b"n1 after the restart" * 10
    assert await again.put_payload("n1", 0, later, claimed=later) == 200
    assert (await again.submit("n1", 0, later, FP_A))[1]["accepted"] is True
    manifest = (await closed_manifest(again, 0)).manifest
    assert [e.node_id for e in manifest.gather] == ["n0", "n1"] and manifest.excluded == {}
    assert len(listings) == 1


@pytest.mark.asyncio
async def test_a_submit_is_answered_while_the_disk_is_still_syncing(
    make_api: ApiFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submission's answer does not wait for the group fsync (a node re-sends one that a
    machine crash lost, ``node.daemon.rounds``); a join's answer still does."""
    api = await make_api(run_config(min_nodes=2, gather_size=4, rounds=3))
    for node in ("n0", "n1"):
        assert (await api.call("POST", "/v1/join", node, {}))[0] == 200
    sync = api.coord.sync
    assert sync is not None
    release = threading.Event()
    inner = sync._fsync
    monkeypatch.setattr(sync, "_fsync", lambda: (release.wait(60), inner())[1])
    try:
        body = b"n0 while the disk is busy" * 10
        assert await api.put_payload("n0", 0, body, claimed=body) == 200
        assert await api.submit("n0", 0, body, FP_A) == (200, {"accepted": True, "reason": None})
        assert sync.pending()  # answered before its commit was synced
        join = asyncio.create_task(api.call("POST", "/v1/join", "n2", {}))
        await asyncio.sleep(0.5)
        assert not join.done()  # a join waits for the disk
    finally:
        release.set()
    assert (await join)[0] == 200


@pytest.mark.asyncio
async def test_a_store_that_refuses_the_listing_gets_a_head_per_submission(
    make_api: ApiFactory, caplog: pytest.LogCaptureFixture
) -> None:
    api = await make_api(run_config(min_nodes=2, gather_size=4, rounds=3))
    for node in ("n0", "n1"):
        assert (await api.call("POST", "/v1/join", node, {}))[0] == 200

    async def refused(prefix: str) -> dict[str, int]:
        raise StorageError(f"list {prefix}: AccessDenied", code="AccessDenied")

    api.coord.store.sizes = refused  # type: ignore[method-assign]
    heads = count_calls(api, "head")
    body = b"n0's payload" * 20
    assert await api.put_payload("n0", 0, body, claimed=body) == 200
    assert (await api.submit("n0", 0, body, FP_A))[1]["accepted"] is True
    ghost = b"n1's payload" * 20
    assert await api.put_payload("n1", 0, b"Z" * len(ghost), claimed=ghost) in (400, 403)
    with caplog.at_level(logging.WARNING, "sparseloco.coordinator"):
        assert (await api.submit("n1", 0, ghost, FP_A))[1]["accepted"] is True
        manifest = (await closed_manifest(api, 0)).manifest
    assert [e.node_id for e in manifest.gather] == ["n0"]
    assert manifest.excluded == {"n1": "bad digest"}
    assert len(heads) == 2
    assert any("event=confirm_list_refused round=0" in m for m in caplog.messages)
