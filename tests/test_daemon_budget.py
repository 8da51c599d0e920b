"""The daemon under a round's time budget, against the in-memory fakes (manual clock).

- A budget that leaves no time to train: every round is cut to one inner step, the payload and
  the signed manifest say so, the report says what cut it, and θ is bit for bit the worker's
  own one-step rounds; two such nodes agree every round.
- A thin link: the payload sends fewer entries per tile, its peers aggregate it with its own k,
  and the nodes still agree.
- A link that cannot get even one entry per tile in: the node says so once, sends nothing, is
  not waited for, and applies every round like the others.
- Overlap "merge": the budget cuts the round after the merge, never before it.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest

from protocol.codec import read_payload
from protocol.keys import payload_key
from protocol.runconfig import RunConfig
from support.daemon_harness import PATIENT, run_config, worker

pytestmark = pytest.mark.asyncio

#: A budget shorter than the node's margin: no time to train beyond the first step.
NO_TIME = PATIENT.model_copy(update={"budget": 0.01})


def budgeted(**changes: object) -> RunConfig:
    return run_config(inner_steps=4, timing=NO_TIME, **changes)


def one_step_reference(run: RunConfig) -> list[str]:
    """θ after each round for one node alone whose budget allows one step a round."""

    def go() -> list[str]:
        w = worker(run)
        out = []
        for _ in range(run.rounds):
            w.cutoff = float("-inf")  # always past: the inner loop stops after its first step
            result = w.train_and_compress()
            assert result.steps == 1
            w.apply({"node-0": w.read(result.payload)})
            out.append(w.fingerprint())
        return out

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(go).result()


async def test_a_budget_with_no_time_cuts_every_round_to_one_step(harness) -> None:
    run = budgeted()
    h = harness(run)
    assert await h.daemon("node-0").run(handle_signals=False) == 0
    expected = one_step_reference(run)
    shapes = worker(run).shapes
    for r in range(run.rounds):
        report = h.reports(r)["node-0"]
        assert report.fingerprint == expected[r]
        assert (report.steps, report.cut, report.topk) == (1, "compute", None)
        (entry,) = h.manifest(r).manifest.gather
        assert entry.steps == 1 and entry.tokens == run.batch_size * 64
        payload = read_payload(h.store.objects[payload_key("", run.run_id, r, "node-0")], shapes)
        assert (payload.steps, payload.tokens) == (entry.steps, entry.tokens)


async def test_two_budgeted_nodes_agree_every_round(harness) -> None:
    h = harness(budgeted(min_nodes=2))
    first, second = h.start(h.daemon("node-0")), h.start(h.daemon("node-1"))
    assert await first == 0 and await second == 0
    for r in range(h.run.rounds):
        reports = h.reports(r)
        assert {n: rep.steps for n, rep in reports.items()} == {"node-0": 1, "node-1": 1}
        assert reports["node-0"].fingerprint == reports["node-1"].fingerprint


async def test_a_thin_link_sends_fewer_entries_per_tile_and_is_aggregated(harness) -> None:
    run = run_config(min_nodes=2, timing=PATIENT.model_copy(update={"budget": 5.0}))
    h = harness(run)
    thin = h.daemon("node-1")
    # Its link as measured: a payload of 100 kB takes 10 s, twice what the budget has room for.
    thin.budgeting.payload_size = 100_000
    thin.budgeting.meter.uploaded(100_000, 10.0)
    first, second = h.start(h.daemon("node-0")), h.start(thin)
    assert await first == 0 and await second == 0
    shapes = worker(run).shapes
    data = h.store.objects[payload_key("", run.run_id, 0, "node-1")]
    sent = read_payload(data, shapes, topk=run.topk)
    assert sent.topk < run.topk
    reports = h.reports(0)
    assert reports["node-1"].cut == "link" and reports["node-1"].topk == sent.topk
    assert {e.node_id for e in h.manifest(0).manifest.gather} == {"node-0", "node-1"}
    for r in range(run.rounds):
        reports = h.reports(r)
        assert reports["node-0"].fingerprint == reports["node-1"].fingerprint
        assert not reports["node-0"].rejected and not reports["node-1"].rejected


async def test_a_node_that_cannot_get_a_payload_in_observes_and_applies_every_round(
    harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sparseloco")
    run = run_config(rounds=4, min_nodes=2, timing=PATIENT.model_copy(update={"budget": 5.0}))
    h = harness(run)
    far = h.daemon("node-1")
    # A 100 MB payload over 1 kB/s: even one entry per tile would take far longer than 5 s.
    far.budgeting.payload_size = 100_000_000
    far.budgeting.meter.uploaded(1000, 1.0)
    first, second = h.start(h.daemon("node-0")), h.start(far)
    assert await first == 0 and await second == 0
    for r in range(run.rounds):
        reports = h.reports(r)
        assert [e.node_id for e in h.manifest(r).manifest.gather] == ["node-0"]
        assert reports["node-1"].fingerprint == reports["node-0"].fingerprint
        assert reports["node-1"].cut == "observing" and reports["node-1"].steps is None
    said = [rec.message for rec in caplog.records if "event=cannot_contribute" in rec.message]
    assert len(said) == 1 and "node=node-1" in said[0] and "sparseloco doctor" in said[0]
    assert not any(k.endswith("node-1.slc") for k in h.store.objects)


async def test_merge_is_never_cut_before_the_aggregate_is_merged(harness) -> None:
    run = budgeted(overlap="merge", overlap_tau=2, min_nodes=2)
    h = harness(run)
    first, second = h.start(h.daemon("node-0")), h.start(h.daemon("node-1"))
    assert await first == 0 and await second == 0
    for r in range(run.rounds):
        reports = h.reports(r)
        assert reports["node-0"].fingerprint == reports["node-1"].fingerprint
        # Round 0 trains alone (nothing in flight): one step; later rounds merge at step 2 and
        # may stop only after it.
        want = 1 if r == 0 else 2
        assert {rep.steps for rep in reports.values()} == {want}, r


async def test_a_round_cut_short_leaves_the_node_on_the_runs_schedule(monkeypatch) -> None:
    """The inner schedule follows the round, not the node's step count: a round cut to one
    step runs at global step r·H, and the next round starts at (r + 1)·H, as everyone's."""
    import node.compute.inner as inner

    run = budgeted()
    seen: list[int] = []
    real = inner.inner_step

    def recording(*args, step: int, **kw):
        seen.append(step)
        return real(*args, step=step, **kw)

    monkeypatch.setattr(inner, "inner_step", recording)

    def go() -> None:
        w = worker(run)
        w.cutoff = float("-inf")
        w.train_and_compress(0)  # cut to one step
        w.cutoff = None
        w.train_and_compress(1)  # a whole round

    with ThreadPoolExecutor(1) as pool:
        pool.submit(go).result()
    H = run.inner_steps
    assert seen == [0, *range(H, 2 * H)]
