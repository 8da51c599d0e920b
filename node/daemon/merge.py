"""Overlap "merge": round k's aggregate is applied at inner step τ of round k+1.

The schedule of ``node.daemon.overlap``, with one difference: the compute thread, training round
k+1 from θ_k, stops after τ inner steps (``RunConfig.merge_step``, the same on every node and
known before the run starts) and waits there for round k's gather set, which the event loop is
fetching beside it. It then validates the payloads, applies them to θ exactly as without overlap
(θ becomes θ_{k+1}: the same arithmetic, the same peer order, so the same bits on every node)
and subtracts the step they took, θ_k - θ_{k+1}, from the parameters being trained
(``Worker.merge``). The remaining H - τ steps train on, and the pseudo-gradient is taken against
θ_{k+1}, which round k+1's payload names as its base: the coordinator checks the base it checks
without overlap (``RunConfig.base_round``).

The hand-off is one ``Handoff`` per round: the compute thread blocks on the event loop's
result of the transfers (``Handoff.wait``, called by ``node.daemon.ops.merge_now`` inside the
``train`` op); anything but a gather set to merge (a stop, a θ that
diverged from the manifest's base, round k's payloads pruned, a failure) abandons round k+1's
training before θ is touched, and the round loop finishes round k the plain way
(``RoundFinisher.finish``: resync, skip to a checkpoint, or stop), since those steps need the
compute thread the merge would be holding.

Crash safety is the other schedules': nothing is written at the merge. The state on disk stays
"submitting k" with θ_k until round k+1's training ends, round k is concluded (settled,
reported) and "submitting k+1" with θ_{k+1} is committed (``node.daemon.pending``), so a crash
at any point before that finishes round k again from its manifest and trains round k+1 again,
merging at the same τ; a crash after it resumes as any overlapped node does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from node.daemon.rounds import Gathered
from node.errors import Abandoned

Rejected = dict[str, str]


@dataclass
class Handoff:
    """Round ``round``'s gather set, from the event loop to the compute thread at step τ."""

    round: int
    loop: asyncio.AbstractEventLoop
    travel: asyncio.Task[Gathered | None]
    #: (set by the compute thread) the payloads that failed validation and those screened out;
    #: None until the merge happened.
    applied: tuple[Rejected, Rejected] | None = None
    #: (set by the compute thread) θ was not the base the manifest names: nothing was merged.
    diverged: bool = False
    #: (set by the compute thread) seconds it stood still at step τ waiting for the transfers:
    #: part of the round's training phase on the clock, none of its training.
    waited_s: float = 0.0
    gathered: Gathered | None = field(default=None, repr=False)

    async def _result(self) -> Gathered | None:
        try:
            return await asyncio.shield(self.travel)
        except Exception:  # the round loop meets it again when it awaits the task
            return None

    def wait(self) -> Gathered:
        """(compute thread) Block until the transfers are done; ``Abandoned`` if they brought
        nothing to merge (the round loop then sees why)."""
        future = asyncio.run_coroutine_threadsafe(self._result(), self.loop)
        start = time.perf_counter()
        try:
            gathered = future.result()
        except BaseException as exc:  # the loop is closing
            raise Abandoned() from exc
        finally:
            self.waited_s = time.perf_counter() - start
        if gathered is None:
            raise Abandoned()
        self.gathered = gathered
        return gathered
