"""Bounded retries: only transient errors are retried, and never twice over.

``node.daemon.retry.retry`` wraps every network call of the node. A transient failure costs an
attempt; anything else fails at once; and a ``RetriesExhausted`` from an inner retry passes
straight through an outer one, so nested retries never multiply their attempts (the coordinator
client's budget would otherwise run once per transfer attempt).
"""

from __future__ import annotations

import pytest

from node.daemon.retry import RetryPolicy, retry
from node.errors import RetriesExhausted, TransferError, TransientError

pytestmark = pytest.mark.asyncio

FAST = RetryPolicy(attempts=4, base_s=0.0, max_delay_s=0.0, budget_s=10.0)


async def test_transient_errors_are_retried_until_success() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise TransientError("503")
        return "ok"

    assert await retry(flaky, policy=FAST, what="flaky") == "ok"
    assert calls == 3


async def test_attempts_run_out_as_retries_exhausted() -> None:
    calls = 0

    async def down() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionRefusedError("down")

    with pytest.raises(RetriesExhausted, match="gave up after 4 attempts"):
        await retry(down, policy=FAST, what="down")
    assert calls == 4


async def test_other_errors_fail_at_once() -> None:
    calls = 0

    async def refused() -> None:
        nonlocal calls
        calls += 1
        raise TransferError("403", 403)

    with pytest.raises(TransferError):
        await retry(refused, policy=FAST, what="refused")
    assert calls == 1


async def test_an_exhausted_inner_retry_is_not_retried_by_an_outer_one() -> None:
    inner_calls = 0

    async def down() -> None:
        nonlocal inner_calls
        inner_calls += 1
        raise TransientError("503")

    async def inner() -> None:
        await retry(down, policy=FAST, what="inner")

    with pytest.raises(RetriesExhausted, match="inner"):
        await retry(inner, policy=FAST, what="outer")
    assert inner_calls == FAST.attempts  # one inner round of attempts, not four of them
