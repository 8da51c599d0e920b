"""The daemon as the round's steps see it: what ``upload``, ``rounds`` and ``overlap`` use of it.

The steps take the daemon that runs them (``node.daemon.loop.NodeDaemon``) as one argument.
They name it by these Protocols rather than by its class, so the imports run one way: ``loop``
imports the steps, which import this module, and none of them imports ``loop`` back.
``NodeDaemon`` has every member named here (the type checker checks it where ``loop`` hands
itself to a step); the tests may hand the steps anything else that has them.

- ``Daemon``: the seams (coordinator, store, clock), the chaos suite's faults, the stop flag and
  the log: what ``upload.submit`` needs;
- ``RoundDaemon``: besides, the node's compute, its pending round, checkpoints and the rest of
  what ``rounds.RoundFinisher`` needs to finish a round;
- (``overlap.OverlapDaemon`` adds the finisher and training, in ``overlap``, beside the
  ``RoundFinisher`` it names.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from node.compute.worker import Worker
from node.daemon.api import Clock, CoordinatorApi, Transfers
from node.daemon.budgeting import Budgeting
from node.daemon.checkpoints import CheckpointSync
from node.daemon.condition import Condition
from node.daemon.faults import Faults
from node.daemon.gather import Spool
from node.daemon.pending import PendingRound
from node.daemon.settings import NodeSettings
from protocol.messages import JoinResponse

T = TypeVar("T")


class Compute(Protocol):
    """The node's compute, one op at a time (``node.daemon.ops.NodeCompute``):
    ``await node("op", *args, **local)``."""

    async def __call__(self, name: str, *args: Any, **local: Any) -> Any: ...


class Daemon(Protocol):
    """What sending a payload needs (``node.daemon.upload``)."""

    api: CoordinatorApi
    transfers: Transfers
    clock: Clock
    faults: Faults
    stopping: asyncio.Event

    @property
    def node_id(self) -> str: ...

    def log(self, event: str, **fields: object) -> None: ...

    async def sleep(self, seconds: float) -> None: ...

    def uploaded(self, size: int, seconds: float) -> None:
        """A payload of ``size`` bytes went up in ``seconds`` (the link's measurement)."""

    @property
    def link_failures(self) -> int:
        """Failed attempts at the coordinator or the store so far (every retry counts)."""
        ...


class RoundDaemon(Daemon, Protocol):
    """What finishing a round needs (``node.daemon.rounds``)."""

    #: The round trained and compressed but not yet applied; None between rounds.
    pending: PendingRound | None
    settings: NodeSettings
    joined: JoinResponse | None
    sync: CheckpointSync
    condition: Condition
    spool: Spool
    budgeting: Budgeting

    @property
    def worker(self) -> Worker: ...

    @property
    def node(self) -> Compute: ...

    async def until_stopped(self, work: Awaitable[T]) -> T | None: ...

    async def resync(self) -> None: ...

    async def save_idle(self) -> str: ...

    async def give_back(self, round_: int) -> None: ...

    def retries_since_last_report(self) -> int: ...
