"""Bandwidth caps (``node.daemon.ratelimit``): rates as people write them, and the bucket's
pace on a manual clock (no wall time: the bucket's sleeps advance the clock they ask for)."""

from __future__ import annotations

import asyncio

import pytest

from node.daemon.ratelimit import CHUNK, Bandwidth, Limits, parse_rate
from node.daemon.settings import load_settings
from protocol.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("100Mbit", 12.5e6),
        ("100 mbit/s", 12.5e6),
        ("1Gbit", 125e6),
        ("800kbit", 100e3),
        ("12.5MB", 12.5e6),
        ("12.5MB/s", 12.5e6),
        ("2000000", 2e6),
        ("10mbps", 10e6),
    ],
)
def test_rates_read_as_people_write_them(text: str, bytes_per_s: float) -> None:
    assert parse_rate(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["", "fast", "-1MB", "0", "0Mbit", "10 furlongs", "1e6"])
def test_a_bad_rate_says_what_it_expects(text: str) -> None:
    with pytest.raises(ConfigError, match="bandwidth"):
        parse_rate(text)


class Manual:
    """A clock that moves only when the bucket sleeps."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds


@pytest.mark.asyncio
async def test_the_bucket_lets_bytes_through_at_its_rate() -> None:
    clock = Manual()
    bw = Bandwidth(1e6, clock=clock, sleep=clock.sleep)
    total = 0
    async for piece in bw.chunks(bytes(10_000_000)):
        assert len(piece) <= CHUNK
        total += len(piece)
    assert total == 10_000_000
    # The first burst is free; the rest goes at 1 MB/s.
    assert clock.t == pytest.approx((10_000_000 - bw.capacity) / 1e6, rel=1e-3)


@pytest.mark.asyncio
async def test_transfers_sharing_a_bucket_share_its_rate() -> None:
    clock = Manual()

    async def sleep(seconds: float) -> None:
        clock.t += seconds
        await asyncio.sleep(0)  # let the other transfer run

    bw = Bandwidth(2e6, clock=clock, sleep=sleep)

    async def drain(n: int) -> int:
        return sum([len(p) async for p in bw.chunks(bytes(n))])

    sizes = await asyncio.gather(drain(3_000_000), drain(3_000_000))
    assert sizes == [3_000_000, 3_000_000]
    assert clock.t == pytest.approx((6_000_000 - bw.capacity) / 2e6, rel=1e-3)


def test_no_caps_by_default() -> None:
    limits = Limits()
    assert limits.upload is None and limits.download is None
    capped = Limits(upload=1e6)
    assert capped.upload is not None and capped.upload.rate == 1e6 and capped.download is None


def test_the_node_takes_its_caps_as_flags_or_environment(tmp_path, monkeypatch) -> None:
    base = {"coordinator": "http://127.0.0.1:8700", "token": "t" * 20, "state_dir": tmp_path}
    monkeypatch.setenv("SPARSELOCO_NODE_DOWNLOAD_LIMIT", "1Gbit")
    settings = load_settings(**base, upload_limit="100Mbit")
    assert settings.upload_limit == 12.5e6 and settings.download_limit == 125e6
    with pytest.raises(ConfigError, match=r"--upload-limit \(or SPARSELOCO_NODE_UPLOAD_LIMIT\)"):
        load_settings(**base, upload_limit="fast")


@pytest.mark.asyncio
async def test_a_slow_cap_throttles_a_transfer_smaller_than_a_chunk() -> None:
    # 10 kB/s: a 40 kB payload after an idle spell takes about 4 s, not nothing (the bucket
    # holds a quarter second of traffic, never a whole chunk).
    clock = Manual()
    bw = Bandwidth(10_000, clock=clock, sleep=clock.sleep)
    async for _ in bw.chunks(b"x" * 40_000):
        pass
    assert bw.capacity == 2_500
    assert clock.t == pytest.approx((40_000 - 2_500) / 10_000, rel=1e-3)
