"""A node whose θ silently diverges, for the tests: the real daemon, one bit of θ flipped.

The daemon itself has no way to misbehave. ``diverge`` wraps a daemon's round finisher at the
point right after an aggregate is applied (``RoundFinisher.faulted``, where the chaos suite's
``crash:mid_apply`` fires; both the plain path and overlap's merge pass it): once the real step
is done, the lowest bit of one parameter is flipped on the compute thread, in memory only. The
node then reports that round with a fingerprint its peers do not share, trains the next round
from the wrong θ, is excluded as "wrong base" and resynchronises, as a machine that silently
corrupted its memory would.

- ``diverge(daemon, once({17}))``: at round 17, the first time it is applied (a restarted
  process starts unarmed, as the chaos runner restarts a crashed node without its faults);
- ``diverge(daemon, lambda r: r == 0)``: every time round 0 is applied (resyncing never helps);
- a chaos scenario's ``corrupt@R`` (``split_faults``): the node is started by
  ``support.cluster``, the rest of its faults in ``SPARSELOCO_FAULTS``;
- ``python -m support.diverge ROUNDS node [flags]``: ``sparseloco node`` with θ flipped after
  each of ``ROUNDS`` (``17`` or ``3,9``) is applied, once each.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection, Sequence

import torch

from node import cli
from node.compute.heap import return_large_blocks
from node.compute.worker import Worker
from node.daemon import serve
from node.daemon.loop import NodeDaemon
from node.daemon.settings import NodeSettings
from protocol.errors import ConfigError

log = logging.getLogger("sparseloco.faults")


def flip_one_bit(worker: Worker) -> None:
    """Flip the lowest bit of the first element of the first parameter (by name) of θ."""
    theta = dict(worker.params)
    first = min(worker.shapes)
    if first not in theta:
        return  # a rank that does not hold it
    flipped = theta[first].detach().clone()
    flipped.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
    theta[first] = flipped
    worker.reset_theta(theta)  # the fingerprint is computed again on demand


def once(rounds: Collection[int]) -> Callable[[int], bool]:
    """True the first time each of ``rounds`` comes, False ever after."""
    left = set(rounds)

    def due(round_: int) -> bool:
        if round_ in left:
            left.discard(round_)
            return True
        return False

    return due


def diverge(daemon: NodeDaemon, due: Callable[[int], bool]) -> NodeDaemon:
    """``daemon`` with θ corrupted after applying each round ``r`` for which ``due(r)``."""
    finisher = daemon.finisher
    applied = finisher.faulted

    async def faulted(round_: int) -> None:
        await applied(round_)
        if due(round_):
            log.warning("event=fault_corrupt round=%d", round_)
            await daemon.compute(flip_one_bit, daemon.worker)

    finisher.faulted = faulted  # type: ignore[method-assign,assignment]
    return daemon


def split_faults(text: str | None) -> tuple[str | None, set[int]]:
    """A chaos scenario's faults for one node: ``SPARSELOCO_FAULTS`` entries (the daemon's own
    hook, ``node.daemon.faults``) and the rounds of its ``corrupt@R`` entries (this module)."""
    kept, rounds = [], set()
    for raw in (text or "").split(","):
        entry = raw.strip()
        if entry.startswith("corrupt@"):
            rounds |= parse_rounds(entry.removeprefix("corrupt@"))
        elif entry:
            kept.append(entry)
    return ",".join(kept) or None, rounds


def parse_rounds(text: str) -> set[int]:
    try:
        rounds = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        rounds = set()
    if not rounds or min(rounds) < 0:
        raise ConfigError(f"diverging node: {text!r} is not a list of rounds (e.g. 17 or 3,9)")
    return rounds


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m support.diverge ROUNDS node [flags]")
        return 2
    rounds = parse_rounds(args.pop(0))

    async def serve_diverging(settings: NodeSettings) -> int:
        async with serve.http_seams(settings) as seams:
            daemon = NodeDaemon(settings, seams.api, seams.transfers, links=seams.links)
            return await diverge(daemon, once(rounds)).run()

    def run_node(settings: NodeSettings) -> int:
        return_large_blocks()
        import uvloop

        return uvloop.run(serve_diverging(settings))

    # ``sparseloco node`` looks ``run_node`` up when it runs: this process runs the diverging one.
    serve.run_node = run_node
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
