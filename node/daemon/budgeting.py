"""The daemon's side of a round's time budget: plan each round, arm the worker, observe.

Each round view names how much of the round's budget is left (``RoundView.budget_in_s``;
``coordinator.rules.budget``). Before it trains a round (or, with overlap, as soon as the round
it is training opens) the node plans it (``node.compute.linkbudget.plan``: its measured encode
and upload against what is left) and arms its worker with the plan: when its training must end
(``Worker.cutoff``, on the monotonic clock) and how many entries per tile its payload sends
(``Worker.send_topk``). The inner loop stops between two steps once the cutoff passed; the
payload then says how many steps it carries.

A node whose link cannot get even one entry per tile in within a whole budget *observes*: it
says so once (``event=cannot_contribute``, with the payload's size, the upload it would take
and the budget), tells the coordinator (``NodeCondition.OBSERVING``: no round waits for it),
and applies every round without training. Every ``RETRY_ROUNDS`` rounds it sends one payload
anyway, still observing (no round waits for it), which measures its link again; once a payload
fits it says ``event=contributing_again`` and trains as before.

The measurements come from the node's own transfers (``LinkMeter``): the seconds and bytes of
its last upload and of its last download, and its last payload's size and encode time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from node.compute.linkbudget import RETRY_ROUNDS, LinkMeter, Plan, payload_bytes, plan
from node.compute.worker import TrainResult, Worker
from node.daemon.condition import Condition
from node.daemon.pending import PendingRound
from protocol.messages import RoundView
from protocol.payload_index import PREFIX
from protocol.reports import Cut
from protocol.runconfig import RunConfig

log = logging.getLogger("sparseloco.node")


@dataclass
class Budgeting:
    """One node's budget state: its link, its last payload, and whether it observes."""

    condition: Condition
    #: The daemon's clock (seconds, monotonic): cutoffs and link measurements are on it.
    clock: Callable[[], float]
    meter: LinkMeter = field(default_factory=LinkMeter)
    #: Bytes and encode seconds of the node's last payload at the run's k (None before one).
    payload_size: int | None = None
    #: Its prefix and header: the bytes that do not shrink with fewer entries per tile.
    header_size: int = 0
    encode_s: float = 0.0
    #: The round from which the node observes (None: it contributes).
    observing_since: int | None = None
    #: The plan the worker is armed with (None: none yet; H steps at the run's k).
    armed: Plan | None = None
    #: Whether a round's training is under way (a plan may still be armed for it).
    training: bool = False

    # -- measurements ----------------------------------------------------------------------------

    def trained(self, result: TrainResult, run_topk: int, tile: int) -> None:
        """A round was trained and encoded: its encode time, and its payload's size as it would
        be at the run's k (``linkbudget.payload_bytes`` scales a smaller one back up)."""
        self.encode_s = result.encode_s
        size = len(result.payload)
        if not size:
            return  # (a rank of a node other than 0: no payload here)
        self.header_size = PREFIX.size + PREFIX.unpack_from(result.payload)[3]
        if result.topk and result.topk < run_topk:
            # The size it would have at the run's k, from its size at k'.
            size = payload_bytes(size, result.topk, run_topk, tile, self.header_size)
        self.payload_size = size

    # -- planning --------------------------------------------------------------------------------

    def plan(self, view: RoundView, worker: Worker) -> Plan:
        """The round's plan from what is left of its budget (``view.budget_in_s``)."""
        return self._fit(view.budget_in_s, worker.run)

    def _fit(self, budget_s: float | None, run: RunConfig) -> Plan:
        return plan(
            budget_s,
            topk=run.topk,
            tile=run.tile,
            payload_size=self.payload_size,
            encode_s=self.encode_s,
            meter=self.meter,
            fixed=self.header_size,
        )

    def begin(self) -> None:
        """A round's training starts (with overlap, before its round opens: ``arm`` follows)."""
        self.training, self.armed = True, None

    def arm(self, worker: Worker, chosen: Plan) -> None:
        """Give the worker the plan's cutoff and k (rank 0's worker; read between steps), on
        the daemon's clock."""
        self.training = True
        self.armed = chosen
        worker.send_topk = chosen.topk
        worker.cutoff_clock = self.clock
        worker.cutoff = None if chosen.train_s is None else self.clock() + chosen.train_s

    def disarm(self, worker: Worker) -> Plan:
        """The round's training ended: the plan it ran under (H steps if none was armed)."""
        chosen, self.armed = self.armed or Plan(None, worker.run.topk), None
        self.training = False
        worker.cutoff = None
        worker.send_topk = None
        return chosen

    def observes(self, view: RoundView, worker: Worker, round_: int, node: str) -> bool:
        """Whether the node sits round ``round_`` out: even one entry per tile would not get in
        within the round's whole budget (``view.budget_s``). Says so once when it starts, and
        once when it ends; every ``RETRY_ROUNDS`` rounds it tries one payload anyway."""
        whole = self._fit(view.budget_s, worker.run)
        if not whole.observing:
            if self.observing_since is not None:
                self.observing_since = None
                self.condition.observe(False)
                log.warning(
                    "event=contributing_again node=%s round=%d upload_s=%.1f budget_s=%.1f",
                    node, round_, whole.upload_s, view.budget_s or 0.0,
                )  # fmt: skip
            return False
        if self.observing_since is None:
            self.observing_since = round_
            self.condition.observe(True)
            log.warning(
                "event=cannot_contribute node=%s round=%d payload_bytes=%d upload_s=%.1f"
                " budget_s=%.1f retry_every=%d (applies every round, sends nothing: see"
                " `sparseloco doctor`)",
                node, round_, self.payload_size or 0, whole.upload_s, view.budget_s or 0.0,
                RETRY_ROUNDS,
            )  # fmt: skip
            return True
        return (round_ - self.observing_since) % RETRY_ROUNDS != 0

    @property
    def observing(self) -> bool:
        return self.observing_since is not None

    def pending(
        self,
        round_: int,
        result: TrainResult,
        chosen: Plan,
        run: RunConfig,
        say: Callable[..., None],
    ) -> PendingRound:
        """Round ``round_``'s pending round from its training under ``chosen``: what cut it
        short, said in one line (``event=round_cut``) when something did."""
        self.trained(result, run.topk, run.tile)
        pending = PendingRound.trained(round_, result)
        pending.cut = cut_of(chosen, result, run.inner_steps, self.observing)
        if pending.cut is not None:
            train_s = "-" if chosen.train_s is None else f"{chosen.train_s:.2f}"
            say(
                "round_cut", by=pending.cut, steps=result.steps, of=run.inner_steps,
                topk=result.topk, train_s=train_s,
            )  # fmt: skip
        return pending


def cut_of(chosen: Plan, result: TrainResult, inner_steps: int, observing: bool) -> Cut | None:
    """What cut the round short, for its report: the link (fewer entries per tile), the budget
    (fewer steps), or nothing; "observing" for a payload sent while observing. A plan that
    would observe for what is left of a round (one entry per tile would not get in, though it
    would in a whole budget: a node that starts the round late) sends one entry per tile after
    the least training: its link cut it."""
    if observing:
        return "observing"
    if chosen.cut in ("link", "observing") or (result.topk and result.topk < chosen.topk):
        return "link"
    if result.steps < inner_steps:
        return "compute"
    return None
