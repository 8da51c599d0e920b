"""Long-polls released in batches (``coordinator.api.wakeups``), and the secret filter's quick test.

- a release wakes the first batch at once and one more batch per turn of the event loop, in
  the order the waiters came, so other work runs between batches; every waiter is woken;
- a waiter that times out leaves nothing behind; a release of a round nobody waits for is a
  no-op; ``release_all`` (the server stopping) wakes everyone at once;
- ``SecretFilter.may_hold`` never says no to a line that holds a secret, and lets the lines
  that hold none through untouched.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from coordinator.api.wakeups import Wakeups
from coordinator.base.redact import SecretFilter


@pytest.mark.asyncio
async def test_release_wakes_a_batch_per_turn_in_order() -> None:
    wakeups = Wakeups(batch=2)
    woken: list[int] = []

    async def waiter(i: int) -> None:
        await wakeups.wait(7, timeout=10.0)
        woken.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in range(5)]
    await asyncio.sleep(0)  # every waiter is waiting
    assert wakeups.keys() == [7]
    wakeups.release(7)
    assert wakeups.keys() == []
    seen = []
    for _ in range(6):
        await asyncio.sleep(0)
        seen.append(len(woken))
    await asyncio.gather(*tasks)
    assert woken == [0, 1, 2, 3, 4]
    assert seen[0] == 2 and 4 in seen and seen[-1] == 5  # two at first, then two per turn


@pytest.mark.asyncio
async def test_timeouts_leave_nothing_and_release_all_wakes_everyone() -> None:
    wakeups = Wakeups(batch=1)
    await wakeups.wait(3, timeout=0.01)
    assert wakeups.keys() == []
    await wakeups.wait(3, timeout=0)  # no wait at all
    wakeups.release(3)  # nobody waits: nothing happens
    tasks = [asyncio.create_task(wakeups.wait(r, timeout=10.0)) for r in (1, 1, 2)]
    await asyncio.sleep(0)
    assert sorted(wakeups.keys()) == [1, 2]
    wakeups.release_all()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=1.0)
    assert wakeups.keys() == []


def test_secret_filter_quick_test_never_misses_a_secret() -> None:
    secrets = ["tok-" + "a" * 20, "another-secret-value-0123456789", "s3-access-key-01"]
    f = SecretFilter(secrets)
    assert not f.may_hold("event=submitted round=3 node=n00012 seq=4 rejected=-")
    for secret in secrets:
        line = f"before {secret} after"
        assert f.may_hold(line)
        record = logging.LogRecord("t", logging.INFO, __file__, 1, "x %s y", (line,), None)
        assert f.filter(record) and secret not in record.getMessage()
    plain = logging.LogRecord("t", logging.INFO, __file__, 1, "round=%d", (3,), None)
    assert f.filter(plain) and plain.args == (3,)  # untouched
    assert not SecretFilter([]).may_hold("anything at all")
