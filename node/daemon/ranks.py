"""A node of several processes under ``torchrun``: rank 0 runs the daemon, every rank computes.

``torchrun --standalone --nproc-per-node N -m node node ...`` starts N copies of ``sparseloco
node`` with the same flags on one host; ``node.daemon.serve.run_node`` sees torchrun's
``WORLD_SIZE`` and comes here. The node is still one participant: one token, one state dir, one
payload a round.

- **Rank 0** runs the ordinary daemon (``NodeDaemon`` with the node's ``Group``): it alone
  joins, talks to the coordinator and moves bytes through the store, and it decides every step.
  Each compute step is an op (``node.daemon.ops``) it announces to the other ranks first.
- **Every other rank** runs ``follow``: it takes each op rank 0 announces, on its own share of
  the node (``node.compute.sharding``: the tensors it owns; FSDP's chunks for the inner steps).
  It never talks to the network: the run config and small arguments come with the ops, a
  peer's payload or a checkpoint as a file rank 0 downloaded into the shared state dir, and the
  training data from the same folder (the run's dataset, which rank 0 fetches shard by shard).

Shutdown: rank 0 decides. SIGTERM or Ctrl-C reach every rank (the launcher passes them on:
torchrun or ``node.daemon.launcher``); a follower notes it (its training stops at the next
step, agreed with the others) and waits for rank 0, which stops as a single-process node does
and, once its daemon has ended cleanly, sends ``STOP``, so every rank exits 0. A node refused
for good (a revoked token) releases its followers the same way: rank 0 alone exits 2, with the
refusal's one line. A rank that dies (a crash, ``kill -9``, the OOM killer) fails the others'
next collective: they exit, the launcher ends the node, and a restart with the same command and
state dir continues from the last commit (``node.compute.state``), with any rank count.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any, NoReturn

from node.compute.group import STOP, Group
from node.daemon.launcher import started_world
from node.daemon.ops import OPS, RankContext
from node.daemon.settings import NodeSettings
from node.errors import Abandoned, RanksError, Refused
from protocol.errors import SparseLoCoError

log = logging.getLogger("sparseloco.ranks")

#: Failures every rank meets alike inside an op (agreed there): a follower goes on to the next.
AGREED = (Abandoned, FloatingPointError, SparseLoCoError)

#: The daemon rank 0 runs: ``node.daemon.serve.serve`` (given by its caller, which imports this
#: module: the import runs one way).
Serve = Callable[[NodeSettings, Group], Coroutine[Any, Any, int]]


def torchrun_world() -> int:
    """How many processes torchrun (or ``sparseloco node --ranks``) started for this node (0
    for neither)."""
    return started_world(os.environ)


def run_ranks(settings: NodeSettings, serve: Serve) -> int:
    """This process's part of a torchrun node: the daemon (``serve``) on rank 0, a follower
    elsewhere.

    Every rank leaves through ``os._exit`` once its part is done, without tearing down its gloo
    groups: by then everything it owns is saved (every save is an op, committed before rank 0
    says ``STOP``), and tearing a group down while the peers leave theirs can abort the process
    in gloo's threads (``std::terminate``, seen in CI on rank 0 and on followers alike), which
    torchrun then reports as a failed node."""
    group = Group.from_env()
    try:
        code = _lead(settings, group, serve) if group.leader else follow(settings, group)
    except SparseLoCoError as exc:
        print(f"sparseloco: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("sparseloco: interrupted", file=sys.stderr)
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    _leave(code)


def _leave(code: int) -> NoReturn:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _lead(settings: NodeSettings, group: Group, serve: Serve) -> int:
    import uvloop

    try:
        code = uvloop.run(serve(settings, group))
    except Refused:
        # Refused for good (a revoked token): the daemon cut its work as for a stop, so the
        # followers wait for the next op. Released, they leave quietly: the node's one line is
        # rank 0's, and their "restart with the same command" would be wrong advice here.
        _release(group)
        raise
    # The daemon ended cleanly (finished or stopped): its compute thread is done and the
    # followers wait for the next op. Were it to fail instead, its exit would end their wait (a
    # collective with a dead rank fails at once).
    _release(group)
    return code


def _release(group: Group) -> None:
    """Tell the followers waiting for rank 0's next op that there is none."""
    try:
        group.send_op(STOP)
    except RanksError as exc:
        log.warning("event=ranks_not_stopped error=%s", exc)


def follow(settings: NodeSettings, group: Group) -> int:
    """Take rank 0's ops until it says ``STOP``; the exit status (0)."""
    ctx = RankContext(settings, group)

    def noted(signum: int, frame: FrameType | None) -> None:
        # Rank 0 leads the shutdown; this rank's training stops at the next step (agreed).
        log.info("event=rank_signal rank=%d signal=%s", group.rank, signal.Signals(signum).name)
        ctx.stop.set()
        if ctx.shard is not None:
            ctx.shard.worker.stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, noted)
    if settings.threads:
        from node.compute.bands import limit_threads

        limit_threads(settings.threads)
    while True:
        name, args = group.receive_op()
        if name == STOP:
            log.info("event=rank_stopped rank=%d", group.rank)
            return 0
        fn = OPS.get(name)
        if fn is None:
            raise RanksError(f"rank {group.rank} got an unknown op {name!r} from rank 0")
        try:
            fn(ctx, *args)
        except AGREED as exc:
            if isinstance(exc, RanksError):
                raise
            # Rank 0 met the same and handles it; this rank waits for the next op.
            log.info("event=rank_op_ended rank=%d op=%s why=%r", group.rank, name, exc)
        if name == "setup" and ctx.shard is not None:
            log.info(
                "event=rank_setup rank=%d model=%s owned=%d", group.rank,
                ctx.shard.worker.run.model, len(ctx.shard.worker.owned),
            )  # fmt: skip
