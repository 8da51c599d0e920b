"""Log lines a person reads: an exception's cause in a few words, and one line per outage.

``protocol.causes.cause`` is fed the exceptions the node and the coordinator really meet (a real
refused connection from aiohttp and from botocore, a timeout, our own errors); ``Link`` is
driven through a run of failures and answers with a fake clock.
"""

from __future__ import annotations

import logging
import socket

import aiohttp
import pytest
from botocore.exceptions import EndpointConnectionError
from yarl import URL

from coordinator.base.errors import StorageError
from node.cluster.seaweed import free_ports
from node.daemon.retry import RetryPolicy, retry
from node.errors import RetriesExhausted, TransferError, TransientError
from protocol.causes import MAX_CAUSE, cause
from protocol.links import Link

SECRET = "X-Amz-Signature=deadbeef"


async def _refused(port: int) -> BaseException:
    async with aiohttp.ClientSession() as http:
        try:
            async with http.get(f"http://127.0.0.1:{port}/key?{SECRET}"):
                pass
        except aiohttp.ClientError as exc:
            return exc
    raise AssertionError("nothing should listen there")


@pytest.mark.asyncio
async def test_a_refused_connection_names_the_address_and_no_repr() -> None:
    (port,) = free_ports(1)
    exc = await _refused(port)
    assert "ConnectionKey(" in repr(exc)  # what the logs used to print
    assert cause(exc) == f"connection refused by 127.0.0.1:{port}"


@pytest.mark.asyncio
async def test_retries_exhausted_reads_as_its_cause() -> None:
    (port,) = free_ports(1)

    async def attempt() -> None:
        raise await _refused(port)

    fast = RetryPolicy(attempts=2, base_s=0.0, max_delay_s=0.0)
    with pytest.raises(RetriesExhausted) as info:
        await retry(attempt, policy=fast, what="download")
    assert "ConnectionKey(" not in str(info.value)
    assert str(info.value).endswith(f"connection refused by 127.0.0.1:{port}")
    assert cause(info.value) == f"connection refused by 127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("exc", "says"),
    [
        (TransientError("POST /v1/probe: HTTP 503", 503), "HTTP 503"),
        (
            TransientError(
                "POST /v1/probe: HTTP 503 storage_unavailable", 503, "storage_unavailable"
            ),
            "HTTP 503 storage_unavailable",
        ),
        (TransientError("upload: HTTP 500: <Error><Code>x</Code></Error>", 500), "HTTP 500"),
        (TimeoutError(), "timed out"),
        (TimeoutError(), "timed out"),
        (aiohttp.ServerDisconnectedError(), "the server closed the connection"),
        (TransferError("download: HTTP 403: expired", 403), "download: HTTP 403: expired"),
        (
            EndpointConnectionError(endpoint_url=f"http://127.0.0.1:8333/bucket/key?{SECRET}"),
            "cannot connect to 127.0.0.1:8333",
        ),
        (StorageError("put k: cannot connect to 127.0.0.1:8333"), "put k: cannot connect to"),
        (ValueError("x" * 500), "ValueError"),
    ],
)
def test_causes_are_short_and_say_what_happened(exc: BaseException, says: str) -> None:
    text = cause(exc)
    assert text.startswith(says)
    assert len(text) <= MAX_CAUSE and SECRET not in text and "(" not in text.split(":")[0]


def test_a_response_error_never_quotes_its_url() -> None:
    request = aiohttp.RequestInfo(
        url=URL(f"http://s/k?{SECRET}"),
        method="GET",
        headers=None,  # type: ignore[arg-type]
        real_url=URL(f"http://s/k?{SECRET}"),
    )
    exc = aiohttp.ClientResponseError(request, (), status=502, message="Bad Gateway")
    assert SECRET in str(exc) and cause(exc) == "HTTP 502"


def test_an_unresolvable_host_is_named() -> None:
    key = type("Key", (), {"host": "store.invalid", "port": 443, "ssl": True})()
    err = socket.gaierror(-2, "Name or service not known")
    exc = aiohttp.ClientConnectorError(key, err)
    assert cause(exc) == "cannot resolve the host name store.invalid"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


def test_a_link_logs_one_line_down_and_one_back_per_outage(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="sparseloco.link")
    clock = Clock()
    link = Link("store", monotonic=clock, wall=clock)
    refused = TransientError("upload: HTTP 503", 503)
    for _outage in range(2):
        for attempt in range(5):
            link.failed("upload", refused, retry_in_s=0.5 * attempt if attempt < 4 else None)
            clock.t += 3
        assert not link.up
        link.answered()
        link.answered()  # answers while up say nothing
        assert link.up
    info = _lines(caplog, logging.INFO)
    assert len(info) == 4
    down, back = info[0], info[1]
    assert down.startswith("event=unreachable service=store since=")
    assert "cause='HTTP 503'" in down and "what='upload'" in down and "next_try_in_s=0.0" in down
    assert back.startswith("event=reachable service=store") and "down_s=15.0" in back
    assert "failed_attempts=5" in back
    assert all(len(line) < 200 for line in info)
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 10 and all("TransientError(" in r.getMessage() for r in debug)
    assert link.failures == 10


def test_a_service_never_reached_is_named_again_at_a_bounded_interval(caplog) -> None:
    """A node given a mistyped address logged one warning and then nothing while it waited; a
    service that never answered is now named again every minute, with where and what to do. An
    outage of a service that answered before gets no reminder."""
    caplog.set_level(logging.INFO, logger="sparseloco.link")
    clock = Clock()
    link = Link("coordinator", where="http://127.0.0.1:8070", hint="run doctor", monotonic=clock)
    refused = TransientError("connection refused by 127.0.0.1:8070", None)
    for _ in range(26):  # 250 s of tries every 10 s
        link.failed("join", refused, retry_in_s=10.0)
        clock.t += 10
    lines = _lines(caplog, logging.INFO)
    reminders = [line for line in lines if line.startswith("event=never_reached")]
    assert lines[0].startswith("event=unreachable") and len(reminders) == 4  # at 60, 120, ...
    assert "at=http://127.0.0.1:8070" in reminders[0] and "hint='run doctor'" in reminders[0]
    assert "down_s=60" in reminders[0] and "down_s=240" in reminders[-1]
    caplog.clear()
    link.answered()
    for _ in range(26):
        link.failed("round", refused, retry_in_s=10.0)
        clock.t += 10
    assert not [line for line in _lines(caplog, logging.INFO) if "never_reached" in line]


def test_a_store_failure_reported_by_the_coordinator_counts_against_the_store(caplog) -> None:
    caplog.set_level(logging.INFO, logger="sparseloco.link")
    store, coordinator = Link("store"), Link("coordinator")
    coordinator.behind = store
    down = TransientError("POST /v1/x: HTTP 503", 503, "storage_unavailable")
    coordinator.failed("POST /v1/x", down, 1.0)
    coordinator.failed("POST /v1/x", down, 1.0)
    assert coordinator.up and not store.up
    assert store.failures == 2 and coordinator.failures == 0
    store.answered()
    lines = _lines(caplog, logging.INFO)
    assert [line.split()[1] for line in lines] == ["service=store", "service=store"]
