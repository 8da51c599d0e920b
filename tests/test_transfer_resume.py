"""Transfers over a link that resets: downloads resume from the last byte, upload parts alone.

A loopback server (``support.cutting_server``) drops chosen connections part way through a
body. Each test counts the requests it saw: a download cut after ``n`` bytes goes on with a
``Range`` that starts ``n`` bytes further (the bytes already received are not fetched again),
in memory and into a file, for one plain GET and for ranged parts; an upload part cut half way
is sent again, and no other part is. The whole object's size and sha256 are still checked.
No store here (``test_multipart.py`` runs the same against SeaweedFS).
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

import aiohttp
import pytest

from node.daemon import multipart
from node.daemon.retry import RetryPolicy
from node.daemon.transfer import get_object, get_to_file
from node.daemon.transferopts import TransferCounts, TransferOptions, TransferTimeouts
from node.errors import DigestError, RetriesExhausted
from protocol.parts import MultipartGrant, PartPlan, PartUrl, part_digests, part_ranges
from support.cutting_server import CuttingServer

pytestmark = pytest.mark.asyncio

FAST = RetryPolicy(attempts=4, base_s=0.01, budget_s=10.0)
#: A transfer with the quick retries and nothing else set.
FAST_OPTIONS = TransferOptions(policy=FAST)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("to_file", [False, True], ids=["memory", "file"])
async def test_one_get_cut_mid_body_resumes_from_the_byte_reached(to_file, tmp_path) -> None:
    body = os.urandom(3 << 20)
    cut = 1 << 20  # a whole WRITE_CHUNK has landed: the file path keeps it too
    counts = TransferCounts()
    async with (
        CuttingServer(body, cut_gets=2, cut_after=cut) as server,
        aiohttp.ClientSession() as http,
    ):
        if to_file:
            target = tmp_path / "object.bin"
            await get_to_file(
                http,
                server.url(),
                target,
                size=len(body),
                sha256=_sha(body),
                options=TransferOptions(policy=FAST, counts=counts),
            )
            got = target.read_bytes()
        else:
            got = await get_object(
                http,
                server.url(),
                size=len(body),
                sha256=_sha(body),
                options=TransferOptions(policy=FAST, counts=counts),
            )
    assert got == body
    # A plain GET, then the rest from the byte reached, twice.
    assert server.seen.ranges == [
        "",
        f"bytes={cut}-{len(body) - 1}",
        f"bytes={2 * cut}-{len(body) - 1}",
    ]
    assert counts.resumed_ranges == 2 and counts.bytes_kept == cut + 2 * cut


@pytest.mark.parametrize("to_file", [False, True], ids=["memory", "file"])
async def test_a_cut_part_resumes_alone_and_the_others_are_fetched_once(to_file, tmp_path) -> None:
    body = os.urandom(5 << 20)
    part = 2 << 20  # parts 0-2M, 2-4M, 4-5M
    cut = 1 << 20
    counts = TransferCounts()
    async with (
        CuttingServer(body, cut_gets=1, cut_after=cut) as server,
        aiohttp.ClientSession() as http,
    ):
        if to_file:
            target = tmp_path / "object.bin"
            await get_to_file(
                http,
                server.url(),
                target,
                size=len(body),
                sha256=_sha(body),
                part_size=part,
                options=TransferOptions(policy=FAST, counts=counts),
            )
            got = target.read_bytes()
        else:
            got = await get_object(
                http,
                server.url(),
                size=len(body),
                sha256=_sha(body),
                part_size=part,
                options=TransferOptions(policy=FAST, counts=counts),
            )
    assert got == body
    first = server.seen.ranges[0]  # the part whose GET arrived first is the one cut
    start = int(first.removeprefix("bytes=").split("-")[0])
    end = min(len(body), start + part)
    resumed = f"bytes={start + cut}-{end - 1}"
    assert sorted(server.seen.ranges) == sorted(
        [f"bytes={s}-{min(len(body), s + part) - 1}" for s in range(0, len(body), part)] + [resumed]
    )
    assert counts.resumed_ranges == 1 and counts.bytes_kept == cut


async def test_a_body_that_stalls_until_the_timeout_resumes_with_its_digest_intact(
    tmp_path: Path,
) -> None:
    """A link that stops carrying bytes mid-body: the attempt's timeout cancels the read (a
    write to the file may be under way), and the next attempt goes on from the bytes on disk;
    the digest hashed as they were written still matches: none counted twice, none missed."""
    body = os.urandom(3 << 20)
    counts = TransferCounts()
    quick = TransferTimeouts(connect_s=5.0, transfer_s=1.0)
    async with (
        CuttingServer(body, cut_gets=1, cut_after=(1 << 20) + 12345, stall=True) as server,
        aiohttp.ClientSession() as http,
    ):
        target = tmp_path / "object.bin"
        await get_to_file(
            http,
            server.url(),
            target,
            size=len(body),
            sha256=_sha(body),
            options=TransferOptions(timeouts=quick, policy=FAST, counts=counts),
        )
    assert target.read_bytes() == body
    assert counts.resumed_ranges == 1
    assert server.seen.ranges == ["", f"bytes={counts.bytes_kept}-{len(body) - 1}"]
    assert counts.bytes_kept >= 1 << 20  # a whole WRITE_CHUNK had landed


async def test_a_store_that_ignores_the_range_on_resume_is_never_spliced() -> None:
    """A 200 with the whole object where a resumed 206 was asked for is refused (retried, then
    given up): its first bytes would land in the middle of the object."""
    body = os.urandom(3 << 20)
    async with (
        CuttingServer(body, cut_gets=1, cut_after=1 << 20, ignore_range=True) as server,
        aiohttp.ClientSession() as http,
    ):
        with pytest.raises(RetriesExhausted):
            await get_object(
                http, server.url(), size=len(body), sha256=_sha(body), options=FAST_OPTIONS
            )
    assert server.seen.ranges[0] == "" and set(server.seen.ranges[1:]) == {
        f"bytes={1 << 20}-{len(body) - 1}"
    }


@pytest.mark.parametrize("to_file", [False, True], ids=["memory", "file"])
@pytest.mark.parametrize("part_size", [8 << 20, 1 << 20, 3 << 20], ids=["one-get", "416", "short"])
async def test_an_object_shorter_than_promised_is_a_digest_error(
    to_file: bool, part_size: int, tmp_path: Path
) -> None:
    """A body that ends cleanly before the promised size (or a range past the object's end,
    416) is the object's fault, not the link's: ``DigestError`` (the peer is dropped by every
    node alike), never a retry."""
    body = os.urandom((4 << 20) + 1000)
    promised = len(body) + (1 << 20)
    async with CuttingServer(body) as server, aiohttp.ClientSession() as http:
        with pytest.raises(DigestError, match=r"bytes|shorter"):
            if to_file:
                await get_to_file(
                    http,
                    server.url(),
                    tmp_path / "x.bin",
                    size=promised,
                    sha256=_sha(body),
                    part_size=part_size,
                    options=FAST_OPTIONS,
                )
            else:
                await get_object(
                    http,
                    server.url(),
                    size=promised,
                    sha256=_sha(body),
                    part_size=part_size,
                    options=FAST_OPTIONS,
                )
    assert len(set(server.seen.ranges)) == len(server.seen.ranges)  # nothing asked twice


async def test_resumed_bytes_are_still_digest_checked() -> None:
    body = os.urandom(3 << 20)
    async with (
        CuttingServer(body, cut_gets=1, cut_after=1 << 20) as server,
        aiohttp.ClientSession() as http,
    ):
        with pytest.raises(DigestError, match="sha256"):
            await get_object(
                http, server.url(), size=len(body), sha256="0" * 64, options=FAST_OPTIONS
            )


def _grant(server: CuttingServer, data: bytes, part_size: int) -> MultipartGrant:
    digests = part_digests(data, part_size)
    parts = [
        PartUrl(
            number=n,
            url=server.url(f"part{n}"),
            headers={"x-amz-checksum-sha256": base64.b64encode(bytes.fromhex(d)).decode()},
        )
        for n, d in enumerate(digests, 1)
    ]
    return MultipartGrant(upload_id="u1", part_size=part_size, parts=parts)


@pytest.mark.parametrize("from_file", [False, True], ids=["memory", "file"])
async def test_an_upload_part_cut_half_way_is_sent_again_alone(from_file, tmp_path: Path) -> None:
    part = 1 << 20
    data = os.urandom(4 * part + 1000)
    counts = TransferCounts()
    async with (
        CuttingServer(b"", cut_puts=frozenset({"/part3"})) as server,
        aiohttp.ClientSession() as http,
    ):
        grant = _grant(server, data, part)
        if from_file:
            source = tmp_path / "object.bin"
            source.write_bytes(data)
            done = await multipart.put_file_parts(
                http, grant, source, len(data), TransferOptions(policy=FAST, counts=counts)
            )
        else:
            done = await multipart.put_parts(
                http, grant, data, TransferOptions(policy=FAST, counts=counts)
            )
    assert sorted(server.seen.puts) == sorted([f"/part{n}" for n in range(1, 6)] + ["/part3"])
    assert counts.retried_parts == 1  # every resend is ours (never aiohttp's own)
    assert [p.number for p in done] == [1, 2, 3, 4, 5]
    assert [p.sha256 for p in done] == part_digests(data, part)
    assert [p.etag for p in done] == [
        f'"{hashlib.md5(data[s:e]).hexdigest()}"' for s, e in part_ranges(len(data), part)
    ]
    assert b"".join(server.stored[f"/part{n}"] for n in range(1, 6)) == data


async def test_the_plan_cuts_at_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multipart, "MULTIPART_THRESHOLD", 12 << 20)
    monkeypatch.setattr(multipart, "UPLOAD_PART_SIZE", 5 << 20)
    assert multipart.part_plan(b"x" * ((12 << 20) - 1)) is None
    data = os.urandom(12 << 20)
    plan = multipart.part_plan(data)
    assert plan == PartPlan(part_size=5 << 20, sha256=part_digests(data, 5 << 20))
    assert len(plan.sha256) == 3 and plan.fits(len(data)) and not plan.fits(len(data) + (5 << 20))
