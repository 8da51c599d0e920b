"""Resynchronising: starting again from the newest checkpoint, and the guard that ends a loop
of resync, replay, diverge.

A node whose θ differs from a round's base resynchronises (``NodeDaemon.resync``): it starts
again from the newest checkpoint (or θ_0) and replays the rounds since. A resync that is needed
again at the round the previous one started from, or before it, did not help: the node computes
differently from its peers, the checkpoint it loads is rejected, or what it downloads is not
what they applied. After ``MAX_RESYNCS`` of those in a row the node stops with ``ResyncError``
(its state kept) instead of looping forever.
"""

from __future__ import annotations

from node.daemon.host import RoundDaemon
from node.errors import ResyncError, StateError
from protocol.messages import RoundView

#: Resynchronisations in a row that may end where the previous one began (the node diverges
#: again at the same round or before it) before the node stops instead of looping.
MAX_RESYNCS = 3


class ResyncGuard:
    """Counts the resyncs that did not get past the furthest round one started from."""

    def __init__(self) -> None:
        #: The furthest round a resync started from, and how many in a row did not get past it.
        self.furthest = -1
        self.in_a_row = 0

    def count(self, round_: int, rejected: str | None = None) -> None:
        """A resync starts at ``round_``; ``ResyncError`` if it is one too many in a row
        (``rejected``: why the newest checkpoint was refused, if it was)."""
        self.in_a_row = self.in_a_row + 1 if round_ <= self.furthest else 1
        self.furthest = max(self.furthest, round_)
        if self.in_a_row > MAX_RESYNCS:
            raise ResyncError(
                f"θ diverged from its peers at round {round_} again right after resynchronising"
                f" ({MAX_RESYNCS} times in a row"
                + (f"; the newest checkpoint was rejected: {rejected}" if rejected else "")
                + "). This node cannot follow the run (its arithmetic differs from its peers',"
                " e.g. another torch build or device, or what it downloads is not what they"
                " applied), so it stopped instead of looping; its state is kept. Show the"
                " operator the log (event=diverged, event=resynced)"
            )


async def resync(d: RoundDaemon, guard: ResyncGuard) -> None:
    """θ differs from the round's base: start again from the newest checkpoint (or θ_0).

    A pending payload trained from the wrong θ goes back into the error buffer first, so
    nothing this node computed is lost; the loop then replays the manifests since. A resync
    that does not get the node past where the previous one began is counted by ``guard``.
    """
    guard.count(d.worker.round, d.sync.rejected)
    if d.pending is not None:
        await d.give_back(d.pending.round)
    d.pending = None
    info = await d.sync.restore_latest(d.worker)
    if info is None:
        await d.node("reset_to_initial")
    await d.save_idle()
    d.log("resynced", source=f"checkpoint {info.round}" if info else "θ_0")


def refuse_if_ahead(local_round: int, view: RoundView) -> None:
    """``StateError`` if the node's state is at a round the coordinator has not reached: the
    coordinator lost rounds this node applied; nothing can be done here but say so."""
    if local_round > view.round:
        raise StateError(
            f"local state is at round {local_round} but the coordinator is at {view.round}: it"
            " lost rounds this node applied (restored from an old backup, with their"
            " manifests missing from the store) or this state dir belongs to another"
            " coordinator database; nothing was applied, tell the run's operator"
        )
