"""The coordinator's live dashboard (``GET /``), looked at in a real headless browser.

Debian's ``chromium`` driven by selenium through ``chromedriver`` (both from the distribution, so
their versions match; nothing is downloaded). Two views of the page, as a person reads it:

- a real run: SeaweedFS, ``python -m coordinator`` and two ``python -m node`` processes train the
  tiny model for a few rounds while the page is open; it must show the waiting run before any
  node joined, then the rounds as they close, and at the end the round counter, the members and
  their state, each round's gather set, fingerprints that agree, and one chart point per round,
  all equal to what ``GET /v1/status`` says;
- hostile text: the real dashboard handlers beside a canned ``/v1/status`` whose node ids,
  exclusion reasons and run name are HTML; the page must show them as text and create no element
  from them.

``DASHBOARD_SCREENSHOT=docs/dashboard.png`` saves a screenshot of the finished run's page
(``DASHBOARD_ROUNDS`` lengthens the run for it; the default 3 keeps this file fast).
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from selenium.webdriver.chrome.webdriver import WebDriver

from coordinator.api.handlers import HANDLERS
from coordinator.api.openapi import openapi_document
from node.cluster.seaweed import EmbeddedStore
from protocol.routes import ROUTES
from protocol.runconfig import RunConfig, Timing
from protocol.status import StatusView
from support.browser import (
    DOWN,
    EXCLUDED,
    FINGERPRINTS,
    GATHER,
    LOSS,
    ROUND,
    TOOK,
    UP,
    closed_rows,
    console_errors,
    save_screenshot,
    wait_page,
)
from support.cluster import Cluster

#: The page's poll interval in these tests (``?poll=`` seconds; 2 s by default).
POLL = "0.25"
TIMING = Timing(first_round_s=120, min_round_s=60, max_round_s=120, heartbeat_timeout_s=30)


def _mean_eval_loss(status: StatusView, round_: int) -> float:
    (summary,) = [r for r in status.rounds if r.round == round_]
    losses = [r.eval_loss for r in summary.reports.values() if r.eval_loss is not None]
    return sum(losses) / len(losses)


# ---- a real run ----


def test_dashboard_follows_a_real_run(
    browser: WebDriver, tmp_path: Path, store: EmbeddedStore
) -> None:
    rounds = int(os.environ.get("DASHBOARD_ROUNDS", "3"))
    run = RunConfig(
        name="dashboard",
        model="tiny",
        rounds=rounds,
        inner_steps=5,
        batch_size=4,
        min_nodes=2,
        checkpoint_every=2,
        eval_every=1,  # a loss on every row and a chart point per round
        timing=TIMING,
    )
    cluster = Cluster(tmp_path, store, run, 2)
    try:
        cluster.start_coordinator()
        browser.get(f"{cluster.url}/?poll={POLL}")
        console_errors(browser)  # start the log afresh

        # No node yet: a waiting run with zero rounds.
        page = wait_page(browser, "the waiting run", lambda p: p["state"] == "waiting")
        assert page["counter"] == f"round 0 of {rounds}"
        assert page["run_id"] == run.run_id
        assert page["note"] == "waiting for members: 0 active, 2 needed"
        assert page["members"] == [] and page["members_empty"] == "no members yet"
        assert page["chart_text"] == "no evaluated rounds yet"

        for name in cluster.tokens:
            cluster.start_node(name)
        # The rounds appear as they close, and the count shown never goes back.
        history: list[int] = []

        def finished(p: dict[str, Any]) -> bool:
            history.append(len(closed_rows(p)))
            return p["state"] == "finished"

        wait_page(browser, "the run finish", finished)
        assert history == sorted(history) and history[-1] == rounds, history
        status = cluster.wait_finished()

        # Every node has reported every round, and the page shows what the status says.
        def settled(p: dict[str, Any]) -> bool:
            members = {(row[0], row[1]) for row in p["members"]}
            reported = all("2 nodes" in row[FINGERPRINTS] for row in closed_rows(p))
            return members == {(m.node_id, m.state.value) for m in status.members} and reported

        page = wait_page(browser, "the finished run as the status has it", settled)
        assert page["counter"] == f"{rounds} of {rounds} rounds done"  # not "round 40 of 40"
        assert page["state"] == "finished"
        assert page["note"] == f"all {rounds} rounds closed"
        assert sorted(row[0] for row in page["members"]) == ["node-0", "node-1"]

        shown = [row[:2] for row in page["rounds"]]
        assert shown == [[str(r), "closed"] for r in reversed(range(rounds))]
        by_round = {s.round: s for s in status.rounds}
        for row, chips in zip(page["rounds"], page["gathers"], strict=True):
            summary = by_round[int(row[ROUND])]
            assert chips == summary.gather == ["node-0", "node-1"]
            assert row[EXCLUDED] == "none"
            fingerprint = summary.fingerprints["node-0"]
            assert row[FINGERPRINTS] == f"agree · 2 nodes · {fingerprint[:8]}"
            for cell in (row[UP], row[DOWN]):
                assert re.fullmatch(r"\d+(\.\d)? (B|kB|MB)", cell), cell
            assert row[LOSS] == f"{_mean_eval_loss(status, summary.round):.4f}"

        # The chart: one point per closed round, at the loss the nodes reported.
        points = [(int(r), float(loss)) for r, loss in page["points"]]
        assert [r for r, _ in points] == list(range(rounds))
        for r, loss in points:
            assert loss == pytest.approx(_mean_eval_loss(status, r))

        assert status.checkpoint is not None  # checkpoint_every=2: θ_2 was uploaded
        assert page["checkpoint"].startswith(f"θ at the start of round {status.checkpoint.round}")
        assert status.checkpoint.fingerprint[:8] in page["checkpoint"]
        assert page["connection"].startswith("updated")
        assert console_errors(browser) == []

        if target := os.environ.get("DASHBOARD_SCREENSHOT"):
            save_screenshot(browser, Path(target))
    finally:
        cluster.stop()


# ---- hostile text, on a canned status ----

HOSTILE_NODE = '<img src=x onerror="window.__owned=1">'
HOSTILE_REASON = "<script>window.__owned=2</script> missed <b>deadline</b>"
HOSTILE_NAME = "<i>run</i>"
FP = "0123456789abcdef" * 2
FP_OTHER = "fedcba9876543210" * 2


def _report(
    fingerprint: str, loss: float, rejected: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "fingerprint": fingerprint,
        "rejected": rejected or {},
        "eval_loss": loss,
        "bytes_up": 2800,
        "bytes_down": 5600,
    }


def _waiting_status() -> dict[str, Any]:
    """A waiting run with no round closed yet: one ordinary member and one hostile one."""
    run = RunConfig(name="canned", rounds=3, min_nodes=3).model_dump(mode="json")
    run["name"] = HOSTILE_NAME  # the status is untrusted as a whole, not just the node ids
    member = {"state": "active", "slot": 0, "joined_round": 0, "last_seen_s": 4.0}
    return {
        "run_id": f"{HOSTILE_NAME}-0000",
        "run": run,
        "round": 0,
        "state": "waiting",
        "members": [
            {**member, "node_id": "node-0"},
            {**member, "node_id": HOSTILE_NODE, "slot": 1},
        ],
        "rounds": [{"round": 0, "state": "waiting"}],
        "checkpoint": None,
    }


def _finished_status() -> dict[str, Any]:
    """Two closed rounds: a hostile exclusion, a hostile rejection, fingerprints that differ."""
    status = _waiting_status()
    status["run"]["rounds"] = 2
    status.update(round=2, state="finished")
    status["members"][1]["state"] = "timed out"
    # A revoked node's last speed is history, not a live figure: the members table hides it.
    status["members"].append({**status["members"][0], "node_id": "node-1", "slot": 2})
    status["members"][2]["state"] = "revoked"
    reject = {"node-0": {"node-0": HOSTILE_REASON}}
    status["rounds"] = [
        {
            "round": 0,
            "state": "closed",
            "gather": ["node-0"],
            "excluded": {HOSTILE_NODE: HOSTILE_REASON},
            "fingerprints": {"node-0": FP},
            "reports": {"node-0": _report(FP, 5.25, reject["node-0"])},
            "duration_s": 0.5,
        },
        {
            "round": 1,
            "state": "closed",
            "gather": ["node-0", HOSTILE_NODE],
            "excluded": {},
            "fingerprints": {"node-0": FP, "node-1": FP, HOSTILE_NODE: FP_OTHER},
            "reports": {
                "node-0": {**_report(FP, 4.5), "tokens_per_s": 51234.6, "mfu": 0.4123},
                "node-1": {**_report(FP, 4.5), "tokens_per_s": 40000.0},
                # Its time budget cut it to 2 of the run's 30 steps, its link to 16 per tile.
                HOSTILE_NODE: {**_report(FP_OTHER, 4.75), "steps": 2, "cut": "link", "topk": 16},
            },
            "duration_s": 0.75,
            "budget_s": 0.8,
            "work": {
                "node-0": {"steps": 30, "tokens": 7680, "share": 30 / 32},
                HOSTILE_NODE: {"steps": 2, "tokens": 512, "share": 2 / 32},
            },
        },
    ]
    status["checkpoint"] = {
        "run_id": status["run_id"],
        "round": 1,
        "fingerprint": FP,
        "key": f"{HOSTILE_NAME}/checkpoints/1/model.safetensors",
        "sha256": "0" * 64,
        "size": 480_000,
        "node_id": HOSTILE_NODE,
        "created_at": 0.0,
    }
    return status


@pytest_asyncio.fixture
async def canned() -> Any:
    """The real dashboard handlers beside a ``/v1/status`` that answers ``holder['status']``."""
    app = web.Application()
    holder: dict[str, Any] = {"status": _waiting_status()}

    async def status(request: web.Request) -> web.Response:
        return web.json_response(holder["status"])

    for name in ("dashboard", "dashboard_script", "dashboard_style"):
        app.router.add_route("GET", ROUTES[name].path, HANDLERS[name])
    app.router.add_route("GET", ROUTES["status"].path, status)
    server = TestServer(app)
    await server.start_server()
    try:
        yield server, holder
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_dashboard_files_are_served_with_a_strict_policy(canned: Any) -> None:
    server, _ = canned
    kinds = {
        "/": "text/html",
        "/dashboard/app.js": "text/javascript",
        "/dashboard/style.css": "text/css",
    }
    async with ClientSession() as http:
        for path, kind in kinds.items():
            async with http.get(server.make_url(path)) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"] == f"{kind}; charset=utf-8"
                assert resp.headers["Cache-Control"] == "no-cache"
                csp = resp.headers["Content-Security-Policy"]
                assert "default-src 'self'" in csp and "unsafe" not in csp
                assert resp.headers["X-Content-Type-Options"] == "nosniff"
    doc = openapi_document()["paths"]
    assert "text/html" in doc["/"]["get"]["responses"]["200"]["content"]
    assert "security" not in doc["/"]["get"]


@pytest.mark.asyncio
async def test_hostile_strings_show_as_text(browser: WebDriver, canned: Any) -> None:
    server, holder = canned
    await asyncio.to_thread(browser.get, str(server.make_url(f"/?poll={POLL}")))
    await asyncio.to_thread(console_errors, browser)

    page = await asyncio.to_thread(
        wait_page, browser, "the waiting run", lambda p: p["updates"] > 0
    )
    assert page["counter"] == "round 0 of 3" and page["state"] == "waiting"
    assert page["note"] == "waiting for members: 2 active, 3 needed"
    assert page["run_id"] == f"{HOSTILE_NAME}-0000"
    assert page["run_config"].startswith(f"{HOSTILE_NAME} · model tiny")
    assert [row[:2] for row in page["members"]] == [["node-0", "active"], [HOSTILE_NODE, "active"]]
    assert page["members"][0][4] == "4.0 s ago"
    assert page["chart_text"] == "no evaluated rounds yet"
    assert page["rounds"][0][:3] == ["0", "waiting", "–"]
    assert page["checkpoint"] == "none yet"

    holder["status"] = _finished_status()
    page = await asyncio.to_thread(
        wait_page, browser, "the finished run", lambda p: p["state"] == "finished"
    )
    assert page["counter"] == "2 of 2 rounds done"
    assert page["members"][1][:2] == [HOSTILE_NODE, "timed out"]
    assert page["members"][2][:2] == ["node-1", "revoked"]
    assert [row[5] for row in page["members"]] == ["51,235 · MFU 41.2 %", "–", "–"]
    newest, oldest = page["rounds"]
    assert page["gathers"] == [["node-0", HOSTILE_NODE], ["node-0"]]
    # The work each payload carried: a whole round says nothing, a cut one its steps of H.
    assert holder["status"]["run"]["inner_steps"] == 30  # the canned run's H
    assert newest[GATHER] == f"node-0 {HOSTILE_NODE} 2/30 link k=16"
    assert oldest[GATHER] == "node-0"
    assert newest[TOOK] == "0.75 s / 0.80 s" and oldest[TOOK] == "0.50 s"
    assert oldest[EXCLUDED].splitlines() == [
        f"{HOSTILE_NODE}: {HOSTILE_REASON}",
        f"node-0 rejected node-0: {HOSTILE_REASON}",
    ]
    assert newest[FINGERPRINTS] == f"differ: {HOSTILE_NODE} vs 2 on {FP[:8]}"
    assert oldest[FINGERPRINTS] == f"agree · 1 node · {FP[:8]}"
    assert (newest[UP], newest[DOWN]) == ("8.4 kB", "16.8 kB")
    assert newest[LOSS] == f"{(4.5 + 4.5 + 4.75) / 3:.4f}" and oldest[LOSS] == "5.2500"
    assert [r for r, _ in page["points"]] == ["0", "1"]
    assert HOSTILE_NODE in page["checkpoint"]
    assert f"{HOSTILE_NAME}/checkpoints" in page["checkpoint"]

    # Nothing in the status became markup: no image, no extra script, nothing ran.
    assert page["images"] == 0 and page["scripts"] == 1 and page["owned"] is None
    assert await asyncio.to_thread(console_errors, browser) == []

    # The coordinator going away is shown, and the last view stays.
    await server.close()
    page = await asyncio.to_thread(
        wait_page, browser, "the lost connection", lambda p: "unreachable" in p["connection"]
    )
    assert page["counter"] == "2 of 2 rounds done"


@pytest.mark.asyncio
async def test_a_sparse_eval_schedule_is_drawn_as_the_plan(browser: WebDriver, canned: Any) -> None:
    """``eval_every = 10``: nine rounds in, one loss is all there is; the chart says so."""
    server, holder = canned
    status = _finished_status()
    status["run"].update(rounds=40, eval_every=10)
    status.update(round=1, state="open")
    status["rounds"] = [*status["rounds"][:1], {"round": 1, "state": "open"}]
    holder["status"] = status
    await asyncio.to_thread(browser.get, str(server.make_url(f"/?poll={POLL}")))
    await asyncio.to_thread(console_errors, browser)  # start the log afresh
    page = await asyncio.to_thread(wait_page, browser, "the chart", lambda p: len(p["points"]) == 1)
    assert page["points"] == [["0", "5.25"]]
    assert page["planned"] == ["9", "19", "29", "39"]  # the rounds still to be evaluated
    assert page["loss_summary"] == (
        "round 0: 5.2500 · evaluated after the first round, every 10th and the last"
        " (eval_every = 10); next: round 9"
    )
    assert await asyncio.to_thread(console_errors, browser) == []
