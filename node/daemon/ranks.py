"""A node of several processes under ``torchrun``: rank 0 is the daemon, the others follow.

``torchrun --standalone --nproc-per-node N -m node node ...`` starts N copies of ``sparseloco
node`` with the same flags; ``node.daemon.serve.run_node`` sees torchrun's ``WORLD_SIZE`` and
comes here. Rank 0 runs the ordinary daemon (``RankZeroDaemon``): it alone joins, talks to the
coordinator and the store, owns θ, the error buffer, compression and aggregation, and saves the
state. The other ranks run ``node.compute.ranks.Follower``: they only help with the H inner
steps of each round. Keeping everything but the inner steps on one rank was the simplest
layout and the fastest at the sizes this project runs: the rest of a round is I/O-bound or
small beside H steps, and one owner of θ leaves nothing to keep consistent across ranks.

Shutdown: rank 0 decides. SIGTERM or Ctrl-C reach every rank (torchrun forwards them); the
followers only note it, rank 0 stops as a single-process node does (training abandoned between
steps, the others with it) and, whatever way its daemon ends, sends STOP, so every rank exits.
A follower that dies makes rank 0's next collective fail with a ``RanksError`` that says so.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

import torch

from node.compute.ranks import Follower, Kind, Ranks, lead
from node.compute.worker import TrainResult
from node.daemon.loop import NodeDaemon
from node.daemon.settings import NodeSettings
from node.errors import RanksError

log = logging.getLogger("sparseloco.ranks")


def torchrun_world() -> int:
    """How many processes torchrun started for this node (1 without torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


class RankZeroDaemon(NodeDaemon):
    """The daemon on rank 0: every round's inner steps run on all of the node's ranks."""

    def __init__(self, *args: Any, ranks: Ranks, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ranks = ranks

    def train(
        self, round_: int | None = None, offset: Mapping[str, torch.Tensor] | None = None
    ) -> TrainResult:
        # The worker exists from the join on; its inner loop leads the other ranks from the
        # first round it trains (the setup goes out then, with the run the coordinator sent).
        self.worker.inner = lead(self.worker.inner, self.ranks)
        self.worker.meter.devices = self.ranks.world  # MFU against all the node's devices
        return super().train(round_, offset)


def run_ranks(settings: NodeSettings) -> int:
    """This process's part of a torchrun node: the daemon on rank 0, a follower elsewhere."""
    ranks = Ranks.from_env()
    if ranks.rank == 0:
        try:
            return _lead(settings, ranks)
        finally:
            ranks.close()
    try:
        code = _follow(settings, ranks)
    except BaseException:
        ranks.close()
        raise
    # Told to stop, a follower has nothing to save (rank 0 owns all state). Tearing down its
    # gloo groups while rank 0 tears down its own and exits can abort the process
    # (std::terminate, seen in CI: torchrun then calls the node failed), so it leaves at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _lead(settings: NodeSettings, ranks: Ranks) -> int:
    import uvloop

    from node.daemon.serve import serve

    try:
        return uvloop.run(serve(settings, ranks=ranks))
    finally:
        # However the daemon ended (finished, stopped, failed), its compute thread is done:
        # the followers may go.
        try:
            ranks.send(Kind.STOP)
        except RanksError as exc:
            log.warning("event=ranks_not_stopped error=%s", exc)


def _follow(settings: NodeSettings, ranks: Ranks) -> int:
    def noted(signum: int, frame: FrameType | None) -> None:
        # Rank 0 leads the shutdown (it abandons the round with us and then sends STOP);
        # a dead rank 0 ends our wait at once.
        log.info("event=rank_signal rank=%d signal=%s", ranks.rank, signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, noted)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    return Follower(ranks).serve()
