"""Data parallelism inside one node: the processes ``torchrun`` starts train as one participant.

A node with several GPUs (or several CPU processes) is still one participant of the run: one
token, one θ, one error buffer, one payload a round. Rank 0 owns all of that and alone talks to
the coordinator and the store (``node.daemon.ranks``); the other ranks only help with the H
inner steps. Rank 0 tells them what to do over a control channel (a gloo group, so it works the
same under NCCL) and they follow:

    rank 0                                   ranks 1..N-1
    SETUP + (run, AdamW settings, slot)  ->  build the model and AdamW
    TRAIN r [+ AdamW state] + params     ->  copy the start parameters (θ or θ - offset)
    BATCH + the node's batch of the step ->  take rows rank::world of it
    STEP lr-scale                        ->  step: forward, backward, all-reduce, AdamW
    ABANDON                              ->  the round ends between two steps (a stop, an error)
    STOP                                 ->  exit 0

In a step every rank takes rows ``rank::world`` of the node's batch (``InnerLoop.batch``, read
on rank 0 alone, which also streams the run's dataset from the store, and sent: a few KiB a
step), so the node's batch stays ``run.batch_size``; the gradients and the loss are averaged,
weighted by rows, in one all-reduce between backward and the clip, and every rank takes the
identical AdamW step. Rank 0's model then holds the trained parameters and the round goes on
there as in a single process. AdamW's state is sent only when rank 0's changed outside training
(the first round, a restore from disk); in between the ranks' states stay equal by construction.

Waits: the control channel waits for rank 0 without a limit in practice (rank 0 may wait out an
outage of any length between rounds); a rank that dies closes its connections, which ends every
wait on the others at once. Collectives in a step have ``COLLECTIVE_TIMEOUT``. Any failure of
the channel is a ``RanksError`` that names the phase.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from datetime import timedelta
from enum import IntEnum
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from node.compute.data import Corpus
from node.compute.inner import InnerLoop
from node.compute.model import LanguageModel, build_model, get_preset
from node.compute.optim import InnerOptimConfig, make_adamw
from node.compute.state import adam_tensors, restore_adam
from node.errors import Abandoned, RanksError
from protocol.runconfig import RunConfig

log = logging.getLogger("sparseloco.ranks")

#: Longest a collective inside an inner step (an all-reduce, a broadcast of parameters) may wait
#: for the other ranks: a rank that hangs rather than dies fails the node after this.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
#: How long the ranks wait for rank 0's next command: no limit in practice (rank 0 waits out
#: coordinator and store outages between rounds). A dead rank 0 ends the wait at once.
IDLE_TIMEOUT = timedelta(days=365)


class Kind(IntEnum):
    """The commands of the control channel."""

    SETUP = 1
    TRAIN = 2
    BATCH = 3
    STEP = 4
    ABANDON = 5
    STOP = 6


@dataclass
class Ranks:
    """This process's place among the node's processes, and the collectives they share."""

    rank: int
    world: int
    #: The gloo group of the control channel (the default group carries the tensors).
    control: dist.ProcessGroup
    #: Rank 0: AdamW's state as last known to be equal on every rank (``adam_version``).
    _adam_seen: tuple[object, ...] | None = field(default=None, repr=False)
    #: This step's share of the node's batch (rows here / rows of the node).
    _weight: float = field(default=1.0, repr=False)

    @classmethod
    def from_env(cls, init_method: str = "env://") -> Ranks:
        """Join the node's process group as torchrun describes it (``RANK``, ``WORLD_SIZE``,
        ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``): NCCL for CUDA tensors when this is
        a CUDA build with a GPU (each rank on ``cuda:LOCAL_RANK``), gloo for CPU tensors."""
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local = int(os.environ.get("LOCAL_RANK", "0"))
        except (KeyError, ValueError) as exc:
            raise RanksError(
                f"RANK and WORLD_SIZE must be set ({exc}): start a multi-process node with"
                " torchrun, e.g. torchrun --standalone --nproc-per-node 2 -m node node ..."
            ) from exc
        cuda = torch.cuda.is_available() and dist.is_nccl_available()
        if cuda:
            torch.cuda.set_device(local)
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        with _phase("joining the node's process group"):
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world,
                timeout=COLLECTIVE_TIMEOUT,
            )  # fmt: skip
            control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        log.info(
            "event=rank_ready rank=%d world=%d backend=%s pid=%d", rank, world, backend, os.getpid()
        )
        return cls(rank, world, control)

    def close(self) -> None:
        """Leave the process group (a no-op once it is gone)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- the control channel -------------------------------------------------------------------

    def send(self, kind: Kind, a: float = 0.0, b: float = 0.0) -> None:
        """(rank 0) One command to every other rank."""
        with _phase(f"sending {kind.name}"):
            dist.broadcast(torch.tensor([kind, a, b], dtype=torch.float64), 0, group=self.control)

    def receive(self) -> tuple[Kind, float, float]:
        """(ranks > 0) The next command from rank 0; waits as long as rank 0 lives."""
        message = torch.zeros(3, dtype=torch.float64)
        with _phase("waiting for rank 0"):
            dist.broadcast(message, 0, group=self.control)
        kind, a, b = message.tolist()
        return Kind(int(kind)), a, b

    def objects(self, values: list[object], what: str = "the setup") -> list[object]:
        """Rank 0's ``values`` on every rank (small, picklable: configs, names and shapes)."""
        with _phase(f"sending {what}"):
            dist.broadcast_object_list(values, 0, group=self.control)
        return values

    def send_batch(self, x: Tensor, y: Tensor) -> None:
        """(rank 0) The node's batch of this step to every other rank."""
        self.send(Kind.BATCH, x.shape[0], x.shape[1])
        with _phase("sending the batch"):
            dist.broadcast(torch.stack([x, y]).to("cpu", torch.int64), 0, group=self.control)

    def receive_batch(self) -> tuple[Tensor, Tensor]:
        """(ranks > 0) The node's batch of this step; ``Abandoned`` if rank 0 ends the round."""
        kind, rows, cols = self.receive()
        if kind is Kind.ABANDON:
            raise Abandoned()
        if kind is not Kind.BATCH:
            raise RanksError(f"rank {self.rank} got {kind.name} where a batch was due")
        both = torch.empty((2, int(rows), int(cols)), dtype=torch.int64)
        with _phase("waiting for the batch"):
            dist.broadcast(both, 0, group=self.control)
        return both[0], both[1]

    # -- tensors -----------------------------------------------------------------------------

    def broadcast_params(self, model: torch.nn.Module) -> None:
        """Rank 0's parameters into every rank's model, in one flat message."""
        params = [p.data for p in model.parameters()]
        with torch.no_grad(), _phase("sending the start parameters"):
            flat = torch.cat([p.reshape(-1) for p in params])
            dist.broadcast(flat, 0)
            if self.rank != 0:
                for p, part in zip(params, flat.split([p.numel() for p in params]), strict=True):
                    p.copy_(part.view_as(p))

    def adam_changed(self, opt: torch.optim.Optimizer) -> bool:
        """(rank 0) Whether AdamW's state changed since the ranks last agreed on it."""
        return self._adam_seen is None or adam_version(opt) != self._adam_seen

    def note_adam(self, opt: torch.optim.Optimizer | None) -> None:
        """(rank 0) The ranks agree on ``opt``'s state as it is now (None: they may not)."""
        self._adam_seen = None if opt is None else adam_version(opt)

    def broadcast_adam(self, opt: torch.optim.Optimizer) -> None:
        """Rank 0's AdamW moments and step counts into every rank's optimiser."""
        device = next(iter(opt.param_groups[0]["params"])).device
        tensors = adam_tensors(opt) if self.rank == 0 else {}
        layout = [(n, tuple(t.shape), t.dtype, t.device.type != "cpu") for n, t in tensors.items()]
        (layout,) = self.objects([layout], "the AdamW layout")  # type: ignore[assignment]
        received = {}
        with torch.no_grad(), _phase("sending the AdamW state"):
            for name, shape, dtype, on_device in layout:
                t = tensors.get(name)
                if t is None:
                    t = torch.empty(shape, dtype=dtype, device=device if on_device else "cpu")
                dist.broadcast(t, 0)
                received[name] = t
        if self.rank != 0:
            restore_adam(opt, received)

    def share(self, rows: Tensor) -> Tensor:
        """This rank's rows (``rank::world``) of the node's batch ``rows``."""
        mine = rows[self.rank :: self.world]
        self._weight = mine.shape[0] / rows.shape[0]
        return mine

    def sync(self, model: LanguageModel, loss: Tensor) -> Tensor:
        """(after backward) Every rank's gradients and loss, averaged by rows: the gradient and
        the loss of the node's whole batch, the same on every rank; returns that loss."""
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        with torch.no_grad(), _phase("averaging the gradients"):
            flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
            flat.mul_(self._weight)
            dist.all_reduce(flat)
            parts = flat.split([g.numel() for g in grads] + [1])
            for p, g, part in zip(params, grads, parts, strict=False):
                if p.grad is None:
                    p.grad = part.view_as(p).clone()
                else:
                    g.copy_(part.view_as(g))
        return parts[-1][0]


def adam_version(opt: torch.optim.Optimizer) -> tuple[object, ...]:
    """Which tensors AdamW's state holds and how often each was written: any step, restore or
    in-place change since gives another value."""
    seen: list[object] = []
    for state in opt.state.values():
        for key, value in sorted(state.items()):
            if isinstance(value, Tensor):
                seen += [key, id(value), value._version]
            else:
                seen += [key, value]
    return tuple(seen)


@contextlib.contextmanager
def _phase(what: str) -> Iterator[None]:
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


@dataclass
class LeaderLoop(InnerLoop):
    """Rank 0's inner loop: each round it sends the command, the start parameters (and AdamW's
    state when it changed), and before each step the learning-rate factor; the other ranks take
    the same steps on their rows."""

    def batch(self, step: int) -> tuple[Tensor, Tensor]:
        x, y = super().batch(step)
        if self.ranks is not None:
            self.ranks.send_batch(x, y)
        return x, y

    def train(
        self,
        round_: int,
        *,
        lr_scale: Callable[[], float],
        stop: threading.Event,
        on_step: Callable[[], None] | None = None,
    ) -> list[float]:
        ranks = self.ranks
        if ranks is None:
            raise RuntimeError("LeaderLoop needs ranks")
        send_adam = ranks.adam_changed(self.opt)
        ranks.send(Kind.TRAIN, round_, float(send_adam))
        if send_adam:
            ranks.broadcast_adam(self.opt)
        ranks.broadcast_params(self.model)

        def scale() -> float:
            value = lr_scale()
            ranks.send(Kind.STEP, value)
            return value

        try:
            losses = super().train(round_, lr_scale=scale, stop=stop, on_step=on_step)
        except (Abandoned, FloatingPointError):
            # Every rank stopped at the same step (a non-finite loss is the node's, after the
            # all-reduce): their AdamW states are still equal.
            ranks.note_adam(self.opt)
            with contextlib.suppress(RanksError):  # a lost rank shows at the next round
                ranks.send(Kind.ABANDON)
            raise
        except BaseException:
            ranks.note_adam(None)
            with contextlib.suppress(RanksError):
                ranks.send(Kind.ABANDON)
            raise
        ranks.note_adam(self.opt)
        return losses


def lead(inner: InnerLoop, ranks: Ranks) -> LeaderLoop:
    """(rank 0) ``inner`` as the leader of the node's ranks, which are sent its setup (once per
    call: the run, AdamW's settings, the data slot and the device kind)."""
    if isinstance(inner, LeaderLoop) and inner.ranks is ranks:
        return inner
    if inner.run.batch_size < ranks.world:
        raise RanksError(
            f"the run's batch_size {inner.run.batch_size} is smaller than this node's"
            f" {ranks.world} processes: each needs at least one row of every batch; start"
            f" torchrun with --nproc-per-node {inner.run.batch_size} or fewer"
        )
    device = next(inner.model.parameters()).device.type
    ranks.send(Kind.SETUP)
    ranks.objects([inner.run.model_dump_json(), inner.cfg.model_dump_json(), inner.slot, device])
    ranks.note_adam(None)
    values = {f.name: getattr(inner, f.name) for f in fields(inner)}
    return LeaderLoop(**{**values, "ranks": ranks})


@dataclass
class FollowerLoop(InnerLoop):
    """A follower's inner loop: its batches are rank 0's (it reads no data of its own)."""

    def batch(self, step: int) -> tuple[Tensor, Tensor]:
        if self.ranks is None:
            raise RuntimeError("FollowerLoop needs ranks")
        return self.ranks.receive_batch()


class Follower:
    """A rank > 0: the node's model and AdamW, trained in step with rank 0."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.loop: InnerLoop | None = None
        self._never = threading.Event()

    def serve(self) -> int:
        """Follow rank 0's commands until it says STOP; the exit status (0)."""
        while True:
            kind, a, b = self.ranks.receive()
            if kind is Kind.SETUP:
                self.loop = self._build()
            elif kind is Kind.TRAIN and self.loop is not None:
                self._round(self.loop, int(a), bool(b))
            elif kind is Kind.STOP:
                log.info("event=rank_stopped rank=%d", self.ranks.rank)
                return 0
            elif kind is not Kind.ABANDON:  # ABANDON: the end of a round this rank already left
                raise RanksError(f"rank {self.ranks.rank} got {kind.name} out of order")

    def _build(self) -> InnerLoop:
        run_json, cfg_json, slot, device = self.ranks.objects([None] * 4)
        run = RunConfig.model_validate_json(str(run_json))
        cfg = InnerOptimConfig.model_validate_json(str(cfg_json))
        model_cfg = get_preset(run.model)
        model = build_model(model_cfg, seed=run.seed)
        if device == "cuda":
            model.to(torch.device("cuda", torch.cuda.current_device()))
        elif device != "cpu":
            model.to(torch.device(str(device)))
        opt = make_adamw(model, cfg)
        log.info("event=rank_setup rank=%d model=%s slot=%s", self.ranks.rank, run.model, slot)
        no_data = cast(Corpus, None)  # batches come from rank 0 (``FollowerLoop.batch``)
        return FollowerLoop(run, model, opt, cfg, no_data, int(str(slot)), ranks=self.ranks)

    def _round(self, loop: InnerLoop, round_: int, adam: bool) -> None:
        if adam:
            self.ranks.broadcast_adam(loop.opt)
        self.ranks.broadcast_params(loop.model)
        try:
            loop.train(round_, lr_scale=self._next_step, stop=self._never)
        except Abandoned:
            log.info("event=rank_round_abandoned rank=%d round=%d", self.ranks.rank, round_)
        except FloatingPointError as exc:  # rank 0 saw the same loss and reports it
            log.warning(
                "event=rank_round_failed rank=%d round=%d error=%s", self.ranks.rank, round_, exc
            )

    def _next_step(self) -> float:
        kind, scale, _ = self.ranks.receive()
        if kind is Kind.ABANDON:
            raise Abandoned()
        if kind is not Kind.STEP:
            raise RanksError(f"rank {self.ranks.rank} got {kind.name} inside a round")
        return scale
