"""The processes of one node and what they say to each other: commands, verdicts, small sums.

A node is one participant of the run however many processes it has: under ``torchrun`` each
GPU (or CPU process) is a rank, and the ranks share the node's work (``node.compute.sharding``
says which tensors each one owns). ``Group`` is this process's place among them and the few
collectives the round needs besides FSDP's own:

- the **command channel** (``send_op``/``receive_op``): rank 0 runs the daemon, and before each
  piece of the round's compute it tells the other ranks which one, with its small arguments,
  msgpack-encoded (never pickle: the arguments carry strings that came from the network);
- **verdicts** (``any``): a condition one rank found (a stop request, a payload record that
  fails validation, a state file that cannot be read) becomes every rank's, so all take the
  same branch;
- **exact sums** (``sum_ints``): integer counts (robust screening's sign agreements) summed
  over the ranks, exact whatever the order;
- **bytes** (``all_gather_bytes``, ``gather_bytes``): digests of θ's tensors for the
  fingerprint, a rank's encoded payload records for rank 0, a few floats for the reports.

All of these run on a gloo group, so they work the same when FSDP's tensors travel over NCCL.
``Group.solo()`` is a node of one process: every collective is the identity, no process group
exists, and a single-process node runs exactly the code it ran before ranks existed.

Waits: the command channel waits for rank 0 without a limit in practice (rank 0 may wait out
an outage of any length between rounds); other collectives have ``COLLECTIVE_TIMEOUT``. A rank
that dies closes its connections, which ends every wait on the others at once. Any failure of a
collective is a ``RanksError`` that names what the ranks were doing.

Errors::

    SparseLoCoError
    └── RanksError (RuntimeError)   the node's processes lost each other
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from node.errors import RanksError

log = logging.getLogger("sparseloco.ranks")

#: Longest a collective inside the round's compute may wait for the other ranks: a rank that
#: hangs rather than dies fails the node after this.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
#: How long the ranks wait for rank 0's next command: no limit in practice. A dead rank 0
#: ends the wait at once.
IDLE_TIMEOUT = timedelta(days=365)
#: The command that ends a follower's loop.
STOP = "stop"


@dataclass
class Group:
    """This process's place among its node's processes (``rank`` of ``world``)."""

    rank: int
    world: int
    #: gloo group of the command channel (no timeout to speak of); None for one process.
    control: dist.ProcessGroup | None = None
    #: gloo group of the other collectives here (bounded waits); None for one process.
    short: dist.ProcessGroup | None = None
    #: The local device index under torchrun (``LOCAL_RANK``).
    local_rank: int = 0
    #: The backend the model's tensors use ("gloo", or "cpu:gloo,cuda:nccl").
    backend: str = "gloo"
    #: Started by torchrun (a process group exists), even with one process: the node then
    #: keeps its outer state on its device and trains on FSDP (``node.compute.worker``).
    distributed: bool = False

    @classmethod
    def solo(cls) -> Group:
        """A node of one process: every collective is the identity."""
        return cls(0, 1)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, init_method: str = "env://") -> Group:
        """Join the node's process group as torchrun describes it (``RANK``, ``WORLD_SIZE``,
        ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``): NCCL for CUDA tensors when this is
        a CUDA build with a GPU (each rank on ``cuda:LOCAL_RANK``), gloo for CPU tensors."""
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local = int(os.environ.get("LOCAL_RANK", "0"))
        except (KeyError, ValueError) as exc:
            raise RanksError(
                f"RANK and WORLD_SIZE must be set ({exc}): start a multi-process node with"
                " sparseloco node --ranks 2 ... (or torchrun --standalone --nproc-per-node 2"
                " -m node node ...)"
            ) from exc
        cuda = torch.cuda.is_available() and dist.is_nccl_available()
        if cuda:
            torch.cuda.set_device(local)
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        with phase("joining the node's process group"):
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world,
                timeout=COLLECTIVE_TIMEOUT,
            )  # fmt: skip
            control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
            short = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        log.info(
            "event=rank_ready rank=%d world=%d backend=%s pid=%d", rank, world, backend, os.getpid()
        )
        return cls(rank, world, control, short, local, backend, distributed=True)

    def close(self) -> None:
        """Leave the process group (a no-op once it is gone, or without one)."""
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    # -- the command channel -------------------------------------------------------------------

    def send_op(self, name: str, args: Sequence[Any] = ()) -> None:
        """(rank 0) The next piece of compute, by name, with its msgpack-able arguments."""
        if self.world > 1:
            self._broadcast_bytes(msgpack.packb([name, list(args)], use_bin_type=True), "a command")

    def receive_op(self) -> tuple[str, list[Any]]:
        """(ranks > 0) Rank 0's next command; waits as long as rank 0 lives."""
        data = self._broadcast_bytes(None, "waiting for rank 0")
        try:
            name, args = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.ExtraData) as exc:
            raise RanksError(f"rank {self.rank} got an unreadable command: {exc}") from exc
        return str(name), list(args)

    def _broadcast_bytes(self, data: bytes | None, what: str) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        with phase(what):
            dist.broadcast(size, 0, group=self.control)
            buf = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if data
                else torch.empty(int(size), dtype=torch.uint8)
            )
            if int(size):
                dist.broadcast(buf, 0, group=self.control)
        return data if data is not None else buf.numpy().tobytes()

    # -- verdicts and sums -----------------------------------------------------------------------

    def any(self, flag: bool, what: str = "agreeing on a verdict") -> bool:
        """True on every rank if ``flag`` is true on any rank."""
        if self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        with phase(what):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.short)
        return bool(t.item())

    def flags(self, flags: Sequence[bool], what: str = "agreeing on verdicts") -> list[bool]:
        """Element-wise ``any`` of a list of flags of the same length on every rank."""
        if self.world == 1 or not flags:
            return list(flags)
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int64)
        with phase(what):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.short)
        return [bool(v) for v in t.tolist()]

    def sum_ints(self, array: np.ndarray, what: str = "summing counts") -> np.ndarray:
        """The element-wise sum of an int64 array over the ranks (exact), on every rank."""
        if self.world == 1:
            return array
        t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64).copy())
        with phase(what):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.short)
        return t.numpy()

    def _sized(self, data: bytes) -> tuple[list[int], torch.Tensor]:
        """Every rank's byte count, and ``data`` in a buffer of the longest one's length (gloo
        gathers equal sizes only)."""
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.short)
        counts = [int(s) for s in sizes]
        mine = torch.zeros(max(counts), dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return counts, mine

    def all_gather_bytes(self, data: bytes, what: str = "exchanging digests") -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank."""
        if self.world == 1:
            return [data]
        with phase(what):
            counts, mine = self._sized(data)
            bufs = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(bufs, mine, group=self.short)
        return [b[:n].numpy().tobytes() for b, n in zip(bufs, counts, strict=True)]

    def gather_bytes(self, data: bytes, what: str = "collecting records") -> list[bytes] | None:
        """Every rank's ``data`` in rank order on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [data]
        with phase(what):
            counts, mine = self._sized(data)
            bufs = [torch.empty_like(mine) for _ in range(self.world)] if self.leader else None
            dist.gather(mine, bufs, dst=0, group=self.short)
        if bufs is None:
            return None
        return [b[:n].numpy().tobytes() for b, n in zip(bufs, counts, strict=True)]

    def gather_floats(
        self, values: Sequence[float], what: str = "collecting sums"
    ) -> list[list[float]]:
        """Every rank's ``values`` (the same count on each), in rank order, on every rank."""
        if self.world == 1:
            return [list(values)]
        t = torch.tensor(list(values), dtype=torch.float64)
        out = [torch.empty_like(t) for _ in range(self.world)]
        with phase(what):
            dist.all_gather(out, t, group=self.short)
        return [o.tolist() for o in out]

    def barrier(self, what: str = "waiting for the other ranks") -> None:
        if self.world > 1:
            with phase(what):
                dist.barrier(group=self.short)


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Collective failures (a rank died, a timeout passed) as a ``RanksError`` naming ``what``."""
    try:
        yield
    except (RuntimeError, ValueError) as exc:
        if isinstance(exc, RanksError):
            raise
        raise RanksError(
            f"the node's processes lost each other while {what} ({type(exc).__name__}: {exc})."
            " Another rank exited or hung: see its log lines above; torchrun ends the node,"
            " which can be restarted with the same command and state dir"
        ) from exc
