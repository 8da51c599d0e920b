"""How a node fits a round into its time budget: how long to train, and how much to send.

The coordinator names each round's budget (``coordinator.rules.budget``: by when, from the
round's opening, the members should have submitted). A node that knows how much of it is left
(``RoundView.budget_in_s``) plans the round before it trains (``plan``):

- the upload it will need, from its own measured link (``LinkMeter``: the seconds its last
  uploads and downloads took for their bytes) and its payload's size;
- its encode time (measured the round before) and a margin (``MARGIN_S`` or ``MARGIN_SHARE`` of
  what is left, the larger);
- training takes the rest: it trains until H steps or until then, whichever comes first
  (``Plan.train_s``; ``node.compute.inner`` stops between steps).

**Links are budgeted like compute.** A payload's size hardly depends on the steps it carries
(Top-k per tile: the same entries whatever the steps), so a thin link cannot be answered with
fewer steps. If the upload of a whole payload would take more than ``LINK_SHARE`` of what is
left (and more than ``LINK_MIN_S``), the node sends fewer entries per tile: the largest k' up
to the run's k whose payload fits in that share (``payload_bytes``: positions at their
entropy, 2 bits a value); the error buffer keeps the rest for later rounds, as it keeps all
that Top-k does not send. k' is the payload's own ``topk`` (payload format 3 allows any k up
to the run's); peers aggregate each payload with its own k (``node.compute.bands``). Only when
not even one entry per tile fits in what is left (a 70 B model over 5 Mbit/s) does the node
stop trying: it *observes* (``Plan.observing``): it applies every round, submits none, and says
so once (``NodeCondition.OBSERVING``), so no round waits for it; every ``RETRY_ROUNDS`` rounds
it tries one payload again (the link may have grown, or the budget), which also measures the
link anew.

Pure arithmetic on measured numbers (``tests/test_linkbudget.py``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

#: The least margin a node keeps before the budget's end, for the submit and the jitter.
MARGIN_S = 0.2
#: ...and as a share of the seconds left, when larger (below the coordinator's slack,
#: ``coordinator.rules.budget.SLACK``, so a node at the budget's pace is not cut by it).
MARGIN_SHARE = 0.02
#: The most of what is left the upload may take before the payload sends fewer entries per tile.
LINK_SHARE = 0.5
#: An upload this short never sends fewer entries per tile: a payload that takes under a second
#: is carried by round trips more than by bytes (fewer bytes would hardly be quicker); a
#: round that short is fitted by training less.
LINK_MIN_S = 1.0
#: Rounds an observing node lets pass between two tries of a payload.
RETRY_ROUNDS = 10
#: Bits a kept value costs besides its position: its 2-bit code.
CODE_BITS = 2.0

Cut = Literal["compute", "link", "observing"]


#: Uploads and downloads a ``LinkMeter`` remembers.
METER_SAMPLES = 20


@dataclass
class LinkMeter:
    """The node's own link as its last transfers measured it (bytes, seconds each way).

    An upload of P bytes is predicted at the *slowest* rate among the last ``METER_SAMPLES``
    uploads of at least P / 2 bytes (of all of them when there is none that large), its fixed
    cost in it. Links are not linear: a modem's token bucket, a TCP window already open, let a
    small payload through at once and a large one at the line's rate. So a node that sent fewer
    entries per tile learns nothing from that small upload about a whole payload, and does not
    send one the next round to arrive late; it follows a link that slowed at once."""

    up: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=METER_SAMPLES))
    down: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=METER_SAMPLES))

    def uploaded(self, size: int, seconds: float) -> None:
        if size > 0 and seconds > 0:
            self.up.append((size, seconds))

    def downloaded(self, size: int, seconds: float) -> None:
        if size > 0 and seconds > 0:
            self.down.append((size, seconds))

    def upload_s(self, size: int) -> float | None:
        """Seconds an upload of ``size`` bytes would take; None before any was measured."""
        if not self.up:
            return None
        alike = [(b, s) for b, s in self.up if 2 * b >= size] or list(self.up)
        return max(seconds * size / sent for sent, seconds in alike)

    @property
    def up_rate(self) -> float | None:
        """Bytes per second up, the slowest of the last uploads."""
        return min(b / s for b, s in self.up) if self.up else None

    @property
    def down_rate(self) -> float | None:
        return min(b / s for b, s in self.down) if self.down else None


def bits_per_entry(k: int, tile_len: int) -> float:
    """Bits one kept entry costs at k per tile of ``tile_len``: its share of the positions'
    entropy, log2 C(tile_len, k) / k, and its code."""
    k = max(1, min(k, tile_len))
    log_choose = math.lgamma(tile_len + 1) - math.lgamma(k + 1) - math.lgamma(tile_len - k + 1)
    return log_choose / math.log(2) / k + CODE_BITS


def payload_bytes(full_bytes: int, topk: int, k: int, tile: int, fixed: int = 0) -> int:
    """The size of a payload of ``k`` per tile, from one of ``topk`` per tile of ``full_bytes``
    whose first ``fixed`` bytes (its prefix and header) do not depend on k."""
    tile_len = tile * tile
    ratio = (k * bits_per_entry(k, tile_len)) / (topk * bits_per_entry(topk, tile_len))
    body = max(0, full_bytes - fixed)
    return max(1, fixed + math.ceil(body * ratio))


#: Bytes of a payload's prefix and header besides its tensors' entries, about (per tensor it is
#: some 60 more; ``estimated_payload_bytes`` is for a node that has no payload of its own yet).
HEADER_BYTES = 4096


def estimated_payload_bytes(n_params: int, topk: int, tile: int) -> int:
    """About the size of a payload of ``topk`` per tile for a model of ``n_params``: every
    entry at its share of the positions' entropy and its code (the codec comes within a few
    percent of it, benchmark 1)."""
    tile_len = tile * tile
    kept = n_params * min(topk, tile_len) / tile_len
    return HEADER_BYTES + math.ceil(kept * bits_per_entry(topk, tile_len) / 8)


@dataclass(frozen=True)
class Plan:
    """One round's plan: train for ``train_s`` (None: H steps, no budget), send ``topk`` per
    tile; ``observing``: send nothing (the link cannot get a payload in). ``cut`` is what the
    plan cuts, if anything; ``upload_s`` the upload it counts on."""

    train_s: float | None
    topk: int
    cut: Cut | None = None
    upload_s: float = 0.0

    @property
    def observing(self) -> bool:
        return self.cut == "observing"


def plan(
    budget_in_s: float | None,
    *,
    topk: int,
    tile: int,
    payload_size: int | None,
    encode_s: float,
    meter: LinkMeter,
    fixed: int = 0,
) -> Plan:
    """The plan for a round with ``budget_in_s`` seconds left of its budget (None: no budget).

    ``payload_size``: the bytes of the node's last payload at ``topk`` (None before the first),
    of which ``fixed`` are its prefix and header; ``encode_s``: its last encode's seconds.
    Without a budget there is nothing to fit (H steps at the run's k); without a payload or a
    measured link yet, only the time."""
    if budget_in_s is None:
        return Plan(None, topk)
    margin = max(MARGIN_S, MARGIN_SHARE * budget_in_s)
    left = budget_in_s - encode_s - margin
    whole = meter.upload_s(payload_size) if payload_size else None
    if whole is None or payload_size is None:
        return Plan(max(0.0, left), topk, "compute")
    if whole <= max(LINK_MIN_S, LINK_SHARE * left):
        return Plan(max(0.0, left - whole), topk, "compute", whole)
    for k in range(topk - 1, 0, -1):
        upload = meter.upload_s(payload_bytes(payload_size, topk, k, tile, fixed)) or 0.0
        if upload <= LINK_SHARE * left:
            return Plan(left - upload, k, "link", upload)
    upload = meter.upload_s(payload_bytes(payload_size, topk, 1, tile, fixed)) or 0.0
    if upload < budget_in_s - margin:
        # One entry per tile still gets in, with less than the share (or none) to train: the
        # link is thin, not gone (a slow encode is a matter of compute, never of observing).
        return Plan(max(0.0, left - upload), 1, "link", upload)
    return Plan(0.0, 1, "observing", upload)
