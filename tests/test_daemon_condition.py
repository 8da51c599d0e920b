"""What a node's heartbeats say it is doing (``node.daemon.condition``).

The coordinator holds a round nobody submitted to while a member says ``training`` or
``store_unreachable``, so the node must say ``waiting`` only when it merely waits, and say so
soon after it changes. Pure state and a hand-driven clock; no network.
"""

from __future__ import annotations

import asyncio

import pytest

from node.daemon.condition import GAP_S, Condition
from node.daemon.retry import Link
from protocol.messages import NodeCondition

pytestmark = pytest.mark.asyncio


class StepClock:
    """Sleeps that only yield: the test sees how far ``due`` slept, not real time."""

    def __init__(self) -> None:
        self.slept: list[float] = []
        self.release = asyncio.Event()

    def now(self) -> float:
        return sum(self.slept)

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        if seconds > GAP_S:  # the long pause lasts until the test lets it end
            await self.release.wait()


async def test_the_condition_follows_what_the_node_does() -> None:
    store = Link("store")
    cond = Condition([Link("coordinator"), store])
    assert cond.now() == NodeCondition.TRAINING  # at work unless it says otherwise
    with cond.doing(idle=True):
        assert cond.now() == NodeCondition.WAITING
        with cond.doing(idle=False):  # with overlap it trains while it waits
            assert cond.now() == NodeCondition.TRAINING
        assert cond.now() == NodeCondition.WAITING
        store.failed("put", ConnectionError("refused"))
        assert cond.now() == NodeCondition.STORE_UNREACHABLE
        store.answered()
    assert cond.now() == NodeCondition.TRAINING


async def test_a_change_sends_a_heartbeat_after_the_gap_not_the_interval() -> None:
    cond = Condition([])
    clock = StepClock()
    due = asyncio.ensure_future(cond.due(clock, 30.0))
    await asyncio.sleep(0)
    assert not due.done()  # nothing changed: it waits out the interval
    with cond.doing(idle=True):
        await asyncio.wait_for(due, 5)  # changed: due once the short gap has passed
    assert clock.slept[0] == GAP_S
    # Work that does not change the condition (training while at work) does not wake it.
    cond, clock = Condition([]), StepClock()
    due = asyncio.ensure_future(cond.due(clock, 30.0))
    with cond.doing(idle=False):
        await asyncio.sleep(0.01)
    assert not due.done()
    clock.release.set()
    await asyncio.wait_for(due, 5)
    assert clock.slept == [GAP_S, 30.0 - GAP_S]


async def test_the_end_of_an_idle_wait_is_a_change_too() -> None:
    """A node that waited for a round to close starts work on the next: it must say so soon
    (the wait's end, not only its start, wakes the heartbeat)."""
    cond, clock = Condition([]), StepClock()
    with cond.doing(idle=True):
        await asyncio.wait_for(cond.due(clock, 30.0), 5)  # said "waiting"
        due = asyncio.ensure_future(cond.due(clock, 30.0))
        await asyncio.sleep(0.01)
        assert not due.done()
    await asyncio.wait_for(due, 5)  # at work again: due after the gap, not the interval
    assert cond.now() == NodeCondition.TRAINING
