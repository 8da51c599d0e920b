"""What a real link adds to ``bytes / rate``: round trips, slow start and resets (issue 20).

``bench project`` (docs/benchmarks.md §13) prices a round's transfers as ``bytes / rate`` on a
symmetric link with no delay. A commodity link differs in four ways, each a term here, each
zero on the old link (rate only, RTT 0, no resets), so the old numbers are unchanged:

- **asymmetry**: uploads at the up rate, downloads at the down rate (home: 20 / 100 Mbit/s);
- **sequential requests**: every request the round waits for costs a round trip before its
  first byte. A plain round of one node, from the close of round r-1 to the close of round r
  (``node.daemon.loop``, ``node.daemon.rounds``, ``node.daemon.upload``):

      the submit of r-1 answered, then the manifest of r-1 asked for       2 RTT
      ⌈G / parallel⌉ waves of presigned GETs (``parallel_downloads``)        1 RTT each
      the report of r-1, the round view of r, the upload grant              3 RTT
      the presigned PUT (the submit's own trip is the next round's)         1 RTT

  so ``6 + ⌈G / parallel⌉`` round trips. (The first version of this count had the manifest's
  long-poll already waiting when the round closed, 5 + ⌈G / parallel⌉; docs/benchmarks.md §17
  measured one round trip more on every link: the node asks for the manifest only once its
  submit is answered.) Connections are kept alive (aiohttp's pool), so no handshake per
  request; heartbeats run beside the round and cost nothing on its path. Overlapped
  (``node.daemon.overlap``), the round view at the top of the loop and the report stand
  between two trainings (2 RTT); the round view of the payload's round, the grant, the PUT,
  the submit, the manifest and the GETs travel beside training (5 RTT and the waves).
- **slow start**: a connection idle for longer than its retransmission timeout starts again
  from the initial window (Linux ``tcp_slow_start_after_idle``; between two rounds every
  connection is idle for the whole training), 10 segments (RFC 6928), doubling each round trip
  until it holds the bandwidth-delay product ``rate · RTT``. ``streams`` parallel connections
  (the GETs of one wave) open ``streams`` windows at once and fill the link sooner.
- **resets** (``flaky``): a reset breaks what is in flight; the transfer layer retries it after
  its first pause (``node.daemon.retry``: full jitter, mean ``RetryPolicy.base_s``, 0.25 s) on
  a new connection (one round trip for the handshake, slow start again) and sends the object
  again from its start; a reset between transfers costs the next coordinator request its first
  pause (mean ``FOREVER.base_s``, 0.5 s) and a handshake. Resets arrive at random (a Poisson
  process), so an object that takes longer than the mean time between them restarts
  exponentially often (``restarted_s``). And a round waits for its slowest node: with N nodes
  each hit with probability p in a round, it is delayed whenever any one is, by about one
  node's cost: ``cost · (1 − (1 − p)^N) / p`` (N times one node's cost while hits are rare,
  one node's when every node is hit; docs/benchmarks.md §17 measured the round at 1.27x the
  first version of this term, one node's with a fifth of the pause, on ``flaky@5``).

Jitter is left out (it averages out per request); that a round also waits for the most
delayed of its nodes' requests stayed within benchmark 17's noise at ``far``'s ± 30 ms.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from node.daemon.multipart import MULTIPART_THRESHOLD, UPLOAD_PART_SIZE
from node.daemon.retry import FOREVER, RetryPolicy

#: RFC 6928's initial window, 10 segments of a 1,460-byte MSS (Linux's default since 2.6.39).
INIT_WINDOW_BYTES = 10 * 1460
#: Round trips on a plain round's path besides the downloads (module docstring).
PLAIN_REQUEST_RTTS = 6.0
#: Overlapped, the round trips between two trainings: the loop's round view, the report ...
OVERLAP_PATH_RTTS = 2.0
#: ... and those that travel beside training with the transfers (besides the GETs' waves).
OVERLAP_BESIDE_RTTS = 5.0
#: The node's default parallel GETs (``NodeSettings.parallel_downloads``).
PARALLEL_DOWNLOADS = 8
#: Mean first pause of a retried transfer: full jitter over [0, 2 · base_s] (``retry``).
TRANSFER_PAUSE_S = RetryPolicy().base_s
#: ... and of a retried coordinator request (the client retries with ``FOREVER``).
REQUEST_PAUSE_S = FOREVER.base_s
#: Beyond e^this the expected time of a restarted transfer is "never" (and a float overflows).
MAX_EXPONENT = 700.0


class Link(BaseModel):
    """One node's link to the store and the coordinator."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    up_mbit: float = Field(gt=0.0)
    down_mbit: float = Field(gt=0.0)
    rtt_ms: float = Field(0.0, ge=0.0)
    jitter_ms: float = Field(0.0, ge=0.0)
    #: Mean seconds between resets of the node's connections; None: never.
    reset_every_s: float | None = Field(None, gt=0.0)

    @classmethod
    def symmetric(cls, mbit: float) -> Link:
        """``bench project --links``: the same rate both ways, no delay, no resets."""
        return cls(name=f"{mbit:g} Mbit/s", up_mbit=mbit, down_mbit=mbit)

    @property
    def rtt_s(self) -> float:
        return self.rtt_ms / 1e3


def from_profile(name: str, profile: Any) -> Link:
    """A ``Link`` from a WAN lab profile (``node.research.wan.profiles.LinkProfile``)."""
    reset = getattr(profile, "reset_every_s", None)
    return Link(
        name=name,
        up_mbit=float(profile.up_mbit),
        down_mbit=float(profile.down_mbit),
        rtt_ms=float(profile.rtt_ms),
        jitter_ms=float(getattr(profile, "jitter_ms", 0.0) or 0.0),
        reset_every_s=float(reset) if reset else None,
    )


def lab_links() -> dict[str, Link]:
    """The WAN lab's profiles (home, office, far, flaky) as links."""
    from node.research.wan.profiles import PROFILES

    return {name: from_profile(name, p) for name, p in PROFILES.items()}


def bytes_s(nbytes: float, mbit: float) -> float:
    """``nbytes`` at ``mbit`` Mbit/s, nothing else."""
    return nbytes * 8.0 / (mbit * 1e6)


def slow_start_s(nbytes: float, mbit: float, rtt_s: float, streams: int = 1) -> float:
    """What slow start adds to ``nbytes / rate`` for ``nbytes`` sent on ``streams`` idle
    connections sharing one link of ``mbit`` Mbit/s and ``rtt_s`` round trip (0 if RTT is 0).

    The first windows, ``streams · INIT_WINDOW_BYTES`` together, leave with the request (its
    round trip is counted with the requests); each later round trip carries twice the one
    before, until a window holds ``rate · RTT`` and the link is full. After ``j`` such round
    trips the rest goes at the link's rate: ``j · RTT`` minus what the ``j`` windows carried.
    """
    if rtt_s <= 0.0 or nbytes <= 0.0:
        return 0.0
    rate = mbit * 1e6 / 8.0  # bytes per second
    w0 = streams * INIT_WINDOW_BYTES
    full = max(0, math.ceil(math.log2(rate * rtt_s / w0))) if rate * rtt_s > w0 else 0
    rounds = min(full, math.ceil(math.log2(nbytes / w0 + 1.0)) - 1)
    return max(rounds * rtt_s - w0 * (2.0**rounds - 1.0) / rate, 0.0)


class WireTimes(BaseModel):
    """One node's round on a link, split by cause (seconds); ``bytes`` terms as before."""

    model_config = ConfigDict(frozen=True)

    up_s: float
    down_s: float
    #: Round trips the round waits for (requests, the GETs' waves).
    requests_s: float
    #: Slow start of the PUT and of the GETs.
    slow_up_s: float
    slow_down_s: float
    #: Sequential waves of GETs (``⌈G / parallel⌉``).
    waves: int
    #: Expected seconds lost to resets in a round (``reset_s``); 0 until priced.
    reset_cost_s: float = 0.0

    @property
    def slow_start_s(self) -> float:
        return self.slow_up_s + self.slow_down_s

    @property
    def comm_s(self) -> float:
        """The round's time on the wire without resets."""
        return self.up_s + self.down_s + self.requests_s + self.slow_start_s


def store_round(
    link: Link, payload: float, peers: int, parallel: int = PARALLEL_DOWNLOADS
) -> WireTimes:
    """One payload up, ``peers`` down (``parallel`` at a time) through the store, plus the
    round's requests: the plain round's sequential path on ``link`` (no resets yet)."""
    waves = math.ceil(peers / parallel)
    rtt = link.rtt_s
    return WireTimes(
        up_s=bytes_s(payload, link.up_mbit),
        down_s=bytes_s(peers * payload, link.down_mbit),
        requests_s=(PLAIN_REQUEST_RTTS + waves) * rtt if rtt else 0.0,
        slow_up_s=slow_start_s(payload, link.up_mbit, rtt),
        slow_down_s=slow_start_s(peers * payload, link.down_mbit, rtt, min(peers, parallel)),
        waves=waves,
    )


def restarted_s(seconds: float, per_s: float, penalty_s: float) -> float:
    """Expected extra seconds of a transfer that takes ``seconds`` undisturbed when resets
    arrive at random (``per_s`` a second, a Poisson process) and each one restarts it from its
    start after ``penalty_s``: ``(e^{λt} − 1)(1/λ + c) − t``. About ``λt²/2 + λtc`` while
    ``λt`` is small (half the transfer lost per reset); it grows exponentially beyond: an
    object that takes much longer than the mean time between resets never arrives whole.
    """
    if per_s <= 0.0 or seconds <= 0.0:
        return 0.0
    if per_s * seconds > MAX_EXPONENT:
        return math.inf
    return math.expm1(per_s * seconds) * (1.0 / per_s + penalty_s) - seconds


def reset_s(
    link: Link,
    wire: WireTimes,
    round_s: float,
    payload: float,
    resume_bytes: float | None = None,
    nodes: int = 1,
) -> float:
    """Expected seconds per round lost to resets on ``link`` in a round of ``round_s`` that
    waits for ``nodes`` nodes, each behind such a link.

    One node: a reset of a transfer in flight costs the transfer's first retry pause and a
    new connection's handshake, and the object starts again from its first byte
    (``restarted_s``: the PUT, and each wave of GETs, whose streams all wait for the slowest),
    or only the piece of at most ``resume_bytes`` in flight (multipart parts retried alone,
    ranged GETs resumed). By default as the node does (``node.daemon.multipart``): objects of
    ``MULTIPART_THRESHOLD`` (64 MiB) or more in ``UPLOAD_PART_SIZE`` (8 MiB) pieces, smaller
    ones whole. A reset between transfers costs the next
    coordinator request its first pause and a handshake. The round is delayed whenever any of
    the ``nodes`` is (module docstring).
    """
    if link.reset_every_s is None or round_s <= 0.0:
        return 0.0
    per_s, rtt = 1.0 / link.reset_every_s, link.rtt_s
    penalty = TRANSFER_PAUSE_S + rtt
    if resume_bytes is None:  # as the node does: large objects in parts, small ones whole
        resume_bytes = UPLOAD_PART_SIZE if payload >= MULTIPART_THRESHOLD else payload
    pieces = max(1, math.ceil(payload / resume_bytes))

    def lost(seconds: float) -> float:
        return pieces * restarted_s(seconds / pieces, per_s, penalty)

    put = wire.up_s + wire.slow_up_s
    wave = (wire.down_s + wire.slow_down_s) / wire.waves
    moving = put + wire.waves * wave + (1 + wire.waves) * rtt
    idle = max(round_s - moving, 0.0) * per_s * (REQUEST_PAUSE_S + rtt)
    one = lost(put + rtt) + wire.waves * lost(wave + rtt) + idle
    hit = -math.expm1(-per_s * round_s)  # P(a node is reset at least once in the round)
    return one * (1.0 - (1.0 - hit) ** nodes) / hit
