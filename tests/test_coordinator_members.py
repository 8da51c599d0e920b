"""Members over the coordinator's HTTP API: one process per token, a normal end, counters kept.

- A member is bound to the process that joined it (``X-Sparseloco-Instance``): another process
  with the same token is refused with 409 ``token_in_use`` while the first is alive, and takes
  over after a clean leave or the heartbeat timeout; a restart on the same state directory
  (which names the process before it) takes over at once.
- When the last round closes, the members are ``finished``, never ``timed out``, however long
  they stay silent afterwards.
- The Prometheus counters of a restarted coordinator start from what its database records.

Time is the app's injected clock; ticks are driven by calling the machine's ``tick`` directly.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from node.daemon.instance import claim
from protocol.messages import INSTANCE_HEADER
from protocol.routes import ENDPOINTS
from protocol.runconfig import RunConfig, Timing
from support.api import FP_A, Api, ApiFactory, token

FIRST = "first-process-0001"
SECOND = "second-process-0002"


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


async def call(
    api: Api, method: str, path: str, node: str, body: Any = None, instance: str | None = None
) -> tuple[int, Any, Any]:
    headers = {"Authorization": f"Bearer {token(node)}"}
    if instance is not None:
        headers[INSTANCE_HEADER] = instance
    resp = await api.client.request(method, path, json=body, headers=headers)
    return resp.status, await resp.json(), resp.headers


@pytest.mark.asyncio
async def test_a_second_process_is_refused_until_the_first_is_gone(make_api: ApiFactory) -> None:
    clock = Clock()
    api = await make_api(RunConfig(name="inst", timing=Timing(heartbeat_timeout_s=30)), clock=clock)
    status, _, _ = await call(api, "POST", "/v1/join", "n0", {"instance": FIRST}, FIRST)
    assert status == 200
    clock.t += 10
    for method, path in (("POST", "/v1/join"), ("POST", "/v1/heartbeat"), ("GET", "/v1/round")):
        body = {"instance": SECOND} if path == "/v1/join" else None
        status, err, headers = await call(api, method, path, "n0", body, SECOND)
        assert (status, err["error"]) == (409, "token_in_use"), path
        assert "another process" in err["message"] and "wait 20 s" in err["message"]
        assert headers["Retry-After"] == "20"
    # The first process is untouched; a request naming no process is not checked (old clients).
    assert (await call(api, "POST", "/v1/heartbeat", "n0", instance=FIRST))[0] == 200
    assert (await call(api, "GET", "/v1/round", "n0"))[0] == 200
    # After the heartbeat timeout the second one may take over, and then the first is refused.
    clock.t += 31
    status, joined, _ = await call(api, "POST", "/v1/join", "n0", {}, SECOND)
    assert status == 200 and joined["node_id"] == "n0"
    status, err, _ = await call(api, "POST", "/v1/heartbeat", "n0", instance=FIRST)
    assert (status, err["error"]) == (409, "token_in_use")


@pytest.mark.asyncio
async def test_a_restart_on_the_same_state_directory_takes_over_at_once(
    make_api: ApiFactory, tmp_path: Path
) -> None:
    api = await make_api(RunConfig(name="inst-restart"))
    crashed = claim(tmp_path / "node")
    assert crashed.previous is None
    first = crashed.id
    assert (await call(api, "POST", "/v1/join", "n0", {"instance": first}, first))[0] == 200
    crashed.bound()  # what the crashed process recorded once its join went through
    # A restart that stopped before its join went through records nothing...
    assert claim(tmp_path / "node").previous == first
    restart = claim(tmp_path / "node")  # ...so the one after it still names the bound one
    second, previous = restart.id, restart.previous
    assert previous == first != second
    stranger = {"instance": SECOND, "previous_instance": "someone-else-0003"}
    status, err, _ = await call(api, "POST", "/v1/join", "n0", stranger, SECOND)
    assert (status, err["error"]) == (409, "token_in_use")  # naming another process: no proof
    body = {"instance": second, "previous_instance": previous}
    assert (await call(api, "POST", "/v1/join", "n0", body, second))[0] == 200
    status, err, _ = await call(api, "POST", "/v1/heartbeat", "n0", instance=first)
    assert (status, err["error"]) == (409, "token_in_use")  # the old process is out


@pytest.mark.asyncio
async def test_after_a_clean_leave_a_new_process_joins_at_once(make_api: ApiFactory) -> None:
    api = await make_api(RunConfig(name="inst-leave"))
    assert (await call(api, "POST", "/v1/join", "n0", {}, FIRST))[0] == 200
    assert (await call(api, "POST", "/v1/leave", "n0", instance=FIRST))[0] == 200
    assert (await call(api, "POST", "/v1/join", "n0", {}, SECOND))[0] == 200
    status, st = await api.call("GET", "/v1/status", None)
    assert [m["state"] for m in st["members"]] == ["active"]
    status, err, _ = await call(api, "GET", "/v1/round", "n0", instance="bad id!")
    assert (status, err["error"], err["field"]) == (422, "invalid", INSTANCE_HEADER)


@pytest.mark.asyncio
async def test_members_finish_with_the_run_and_never_time_out(
    make_api: ApiFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "sparseloco.coordinator")
    clock = Clock()
    run = RunConfig(name="finish", rounds=2, min_nodes=2, timing=Timing(heartbeat_timeout_s=30))
    api = await make_api(run, clock=clock)
    for node in ("n0", "n1"):
        await api.call("POST", "/v1/join", node, {})
    for r in range(2):
        for node in ("n0", "n1"):
            await api.contribute(node, r, FP_A)
        assert (await api.manifest("n0", r))[0] == 200
    clock.t += 3600  # the nodes are gone long since; a tick must not call that a timeout
    api.coord.machine.tick()
    st = (await api.call("GET", "/v1/status", None))[1]
    assert st["state"] == "finished" and st["round"] == 2
    assert {m["node_id"]: m["state"] for m in st["members"]} == {"n0": "finished", "n1": "finished"}
    # A node that catches up after the end may still beat and leave; it stays finished.
    assert (await api.call("POST", "/v1/heartbeat", "n0"))[0] == 200
    assert (await api.call("POST", "/v1/leave", "n1"))[0] == 200
    assert (await api.call("POST", "/v1/join", "n2", {}))[0] == 200
    api.coord.machine.tick()
    st = (await api.call("GET", "/v1/status", None))[1]
    assert [m["state"] for m in st["members"]] == ["finished"] * 3
    assert "event=timed_out" not in caplog.text
    assert "event=round_closed round=1 done=2/2" in caplog.text
    assert "event=run_finished rounds=2 members_finished=2" in caplog.text


@pytest.mark.asyncio
async def test_counters_survive_a_restart(make_api: ApiFactory) -> None:
    run = RunConfig(name="metrics", rounds=5, min_nodes=2)
    api = await make_api(run, prefix="metrics-restart")
    for node in ("n0", "n1"):
        await api.call("POST", "/v1/join", node, {})
    await api.contribute("n0", 0, FP_A)
    await api.contribute("n1", 0, FP_A)
    assert (await api.manifest("n0", 0))[0] == 200
    await api.contribute("n0", 1, FP_A)
    status, resp = await api.submit("n1", 1, b"never uploaded", FP_A)  # rejected: bad digest
    assert status == 200 and resp["reason"] == "bad digest"
    assert (await api.manifest("n0", 1))[0] == 200
    with api.coord.machine.db.tx():
        api.coord.machine.db.add_deleted("payload", 4)
    before = (await api.call("GET", "/metrics", None))[1]

    again = await make_api(run, prefix="metrics-restart")  # the same state directory
    after = (await again.call("GET", "/metrics", None))[1]
    for line in (
        "sparseloco_rounds_closed_total 2.0",
        "sparseloco_payloads_gathered_total 3.0",
        'sparseloco_submissions_total{result="accepted"} 3.0',
        'sparseloco_submissions_total{result="bad digest"} 1.0',
        'sparseloco_exclusions_total{reason="bad digest"} 1.0',
        'sparseloco_objects_deleted_total{kind="payload"} 4.0',
    ):
        assert line in after, line
        if "deleted" not in line:
            assert line in before, line  # the live counters said the same before the restart


def test_the_route_table_names_the_new_refusals() -> None:
    for endpoint in ENDPOINTS:
        if endpoint.auth:  # token_revoked, token_in_use, a malformed instance header
            assert {401, 409, 422} <= set(endpoint.errors), endpoint.name
