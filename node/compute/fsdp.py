"""The inner steps of a node of several ranks: torch's FSDP2 over the node's processes.

Under ``torchrun`` the model the H inner steps train is wrapped with
``torch.distributed.fsdp.fully_shard``, each transformer block first (and, for a model with an
output head of its own, the embedding and the head: with a 32 K vocabulary each is bigger than a
block), then the root: every rank holds a dim-0 chunk of every parameter (FSDP's own layout),
one AdamW steps over those chunks, and a forward or backward gathers one unit's parameters at a
time. On CUDA the blocks compute
in bf16 with fp32 master weights and gradient reductions in fp32 (``MixedPrecisionPolicy``),
over NCCL; on the CPU everything stays fp32, over gloo.

The outer state is sharded differently (``node.compute.sharding``: whole tensors, one owner
each), so θ meets the FSDP chunks twice a round (three times with overlap "merge"), one
tensor at a time:

- ``begin``: each tensor's owner sends every rank the rows of its FSDP chunk of θ_r (or of
  θ_r - offset): the model starts the round at θ_r;
- ``shift`` (overlap "merge", at the merge): each owner sends every rank the rows of its FSDP
  chunk of the outer step θ_r - θ_{r+1} it just applied, subtracted from the chunks there;
- ``finish``: every rank sends its chunk of the trained tensor back to the owner, which forms
  the pseudo-gradient θ - θ_trained in its own memory.

Both go bucket by bucket of tensors (``BUCKET_ELEMENTS`` of the model each), one
``all_to_all_single`` a bucket. Nothing here holds a whole model: a rank has its chunks, its own
tensors and, for one bucket at a time, the rows in flight. Evaluation runs the same FSDP model,
each rank on its rows of every held-out batch, the token-weighted sums added over the ranks.

Same interface as ``node.compute.placement.Placement`` (``begin``, ``finish``, ``abandon``,
``synchronize``, ``evaluate``), which is what a single process uses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from node.compute.group import Group, phase
from node.compute.model import LanguageModel, ModelConfig, autocast, model_class

#: Elements of the model one exchange between θ's owners and FSDP's chunks moves: few calls (a
#: call costs every rank a synchronisation; one per tensor measured 1.5x slower at 81 M on 4
#: ranks), bounded scratch (a rank's part of a bucket, both ways: at most 32 MB here).
BUCKET_ELEMENTS = 1 << 22


def chunk_rows(rows: int, world: int) -> list[int]:
    """Rows of each rank's FSDP chunk of a tensor with ``rows`` rows (``torch.chunk``'s split:
    ceil(rows / world) each, the last ones shorter or empty)."""
    size = math.ceil(rows / world) if rows else 0
    return [max(0, min(size, rows - r * size)) for r in range(world)]


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    rows = shape[0] if shape else 1
    return rows, (math.prod(shape) // rows if rows else 0)


class ShardedPlacement:
    """An FSDP2 model over the node's ranks, and how θ gets in and the trained values out."""

    def __init__(
        self,
        cfg: ModelConfig,
        group: Group,
        device: torch.device,
        owners: Mapping[str, int],
        theta: Mapping[str, Tensor],
    ) -> None:
        """``theta``: this rank's θ (the tensors it owns), read at every ``begin``."""
        self.group = group
        self.theta = theta
        self.device = device
        self.owners = dict(owners)
        with torch.device("meta"):
            model = model_class(cfg)(cfg)
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if device.type == "cuda"
            else MixedPrecisionPolicy()
        )
        # The mesh on the training device's type: a CPU node on a machine with GPUs (gloo) as
        # well as a GPU node (NCCL), whatever torch would guess.
        mesh = init_device_mesh(device.type, (group.world,))
        for unit in (*model.units(), *model.edges()):
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model.to_empty(device=device)
        model.reset_buffers()
        #: The model the inner steps train (its parameters are DTensors of FSDP chunks).
        self.train_model: LanguageModel = model
        self._params: dict[str, DTensor] = dict(model.named_parameters())  # type: ignore[arg-type]
        #: Tensors in sorted name order, grouped so that one exchange moves at most
        #: ``BUCKET_ELEMENTS`` of the model (one tensor more at most).
        self._buckets: list[list[str]] = []
        size = BUCKET_ELEMENTS
        for name in sorted(self._params):
            if size >= BUCKET_ELEMENTS:
                self._buckets.append([])
                size = 0
            self._buckets[-1].append(name)
            size += self._params[name].numel()
        for name, p in self._params.items():
            rows, _ = _rows_cols(tuple(p.shape))
            mine = chunk_rows(rows, group.world)[group.rank]
            if p.dim() and p.to_local().shape[0] != mine:
                raise RuntimeError(
                    f"FSDP's chunk of {name} has {p.to_local().shape[0]} rows here, expected {mine}"
                )

    @property
    def names(self) -> list[str]:
        return sorted(self._params)

    # -- θ in, trained values out ----------------------------------------------------------------

    def begin(self, offset: Mapping[str, Tensor] | None = None) -> None:
        """Every rank's FSDP chunks := θ (minus ``offset``, given for the owned tensors)."""
        with torch.no_grad(), phase("sending θ to the FSDP chunks"):
            for bucket in self._buckets:
                self._scatter(bucket, self.theta, offset)

    def shift(self, step: Mapping[str, Tensor]) -> None:
        """(overlap "merge", between inner steps or inside one) Every rank's FSDP chunks -=
        ``step`` (θ_old - θ_new of the owned tensors, the outer step just applied to θ);
        AdamW's moments stay. The same exchange as ``begin``, subtracted instead of copied."""
        with torch.no_grad(), phase("merging the outer step into the FSDP chunks"):
            for bucket in self._buckets:
                self._scatter(bucket, step, subtract=True)

    def _rows(self, name: str) -> tuple[int, list[int], list[int]]:
        """A tensor's row width, its FSDP chunks' row counts and their first rows."""
        rows, cols = _rows_cols(tuple(self._params[name].shape))
        chunks = chunk_rows(rows, self.group.world)
        starts = [sum(chunks[:q]) for q in range(self.group.world)]
        return cols, chunks, starts

    def _scatter(
        self,
        bucket: list[str],
        source: Mapping[str, Tensor],
        offset: Mapping[str, Tensor] | None = None,
        *,
        subtract: bool = False,
    ) -> None:
        """One ``all_to_all_single`` for ``bucket``: each owner sends every rank the rows of
        its FSDP chunk of each tensor of ``source`` (minus ``offset``) it owns there; each
        rank copies them into its chunks (or, with ``subtract``, subtracts them)."""
        world, rank = self.group.world, self.group.rank
        dev = self._local_device()
        outgoing: list[list[Tensor]] = [[] for _ in range(world)]
        for q, to_q in enumerate(outgoing):
            for name in bucket:
                if self.owners[name] != rank:
                    continue
                cols, chunks, starts = self._rows(name)
                if cols == 0:  # an empty tensor: nothing to send
                    continue
                rows = slice(starts[q], starts[q] + chunks[q])
                part = source[name].reshape(-1, cols)[rows]
                if offset is not None:
                    part = part - offset[name].reshape(-1, cols)[rows]
                to_q.append(part.reshape(-1).to(dev, torch.float32))
        out_splits = [0] * world
        places: list[tuple[str, int, int]] = []
        at = 0
        for q in range(world):
            for name in bucket:
                if self.owners[name] == q:
                    cols, chunks, _ = self._rows(name)
                    n = chunks[rank] * cols
                    places.append((name, at, n))
                    at += n
                    out_splits[q] += n
        received = self._exchange(outgoing, out_splits)
        for name, begin, n in places:
            local = self._params[name].to_local()
            values = received[begin : begin + n].view_as(local)
            if subtract:
                local.sub_(values)
            else:
                local.copy_(values)

    def _local_device(self) -> torch.device:
        """Where this rank's chunks live."""
        return next(iter(self._params.values())).to_local().device

    def _flat_chunk(self, name: str) -> Tensor:
        """This rank's chunk of tensor ``name``, flat, in float32."""
        return self._params[name].to_local().detach().reshape(-1).to(torch.float32)

    def _exchange(self, outgoing: list[list[Tensor]], out_splits: list[int]) -> Tensor:
        """One ``all_to_all_single``: the flat float32 pieces of ``outgoing[q]`` go to rank q;
        what comes back, ``out_splits[q]`` values from rank q, in rank order."""
        dev = self._local_device()
        pieces = [piece for to_q in outgoing for piece in to_q]
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float32, device=dev)
        in_splits = [sum(piece.numel() for piece in to_q) for to_q in outgoing]
        received = torch.empty(sum(out_splits), dtype=torch.float32, device=dev)
        dist.all_to_all_single(received, send, out_splits, in_splits)
        return received

    def finish(self) -> dict[str, Tensor]:
        """The pseudo-gradient θ - θ_trained of the owned tensors, in fresh memory beside θ."""
        delta: dict[str, Tensor] = {}
        with torch.no_grad(), phase("collecting the trained tensors"):
            for bucket in self._buckets:
                for name, trained in self._gather(bucket).items():
                    t = self.theta[name]
                    trained = trained.view(t.shape).to(t.device)
                    delta[name] = torch.sub(t, trained, out=trained)
        return delta

    def _gather(self, bucket: list[str]) -> dict[str, Tensor]:
        """One ``all_to_all_single`` for ``bucket``: every rank sends its chunk of each tensor
        to the tensor's owner; the owner's trained tensors, whole."""
        world, rank = self.group.world, self.group.rank
        dev = self._local_device()
        outgoing: list[list[Tensor]] = [
            [self._flat_chunk(name) for name in bucket if self.owners[name] == q]
            for q in range(world)
        ]
        mine = [n for n in bucket if self.owners[n] == rank]
        out_splits = [0] * world
        places: list[tuple[str, int, int, int]] = []
        at = 0
        for q in range(world):
            for name in mine:
                cols, chunks, starts = self._rows(name)
                places.append((name, q, at, chunks[q] * cols))
                at += chunks[q] * cols
                out_splits[q] += chunks[q] * cols
        received = self._exchange(outgoing, out_splits)
        trained = {
            n: torch.empty(self._params[n].shape, dtype=torch.float32, device=dev) for n in mine
        }
        for name, q, begin, n in places:
            cols, chunks, starts = self._rows(name)
            flat = trained[name].view(-1)
            flat[starts[q] * cols : starts[q] * cols + n] = received[begin : begin + n]
        return trained

    def abandon(self) -> None:
        """Training stopped part-way: nothing to undo (θ was never touched)."""

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- evaluation --------------------------------------------------------------------------------

    def evaluate(self, batches: Iterable[tuple[Tensor, Tensor]]) -> float:
        """The held-out loss of θ: each rank its rows of every batch, the sums added up."""
        self.begin()
        model = self.train_model
        was_training = model.training
        model.eval()
        total, tokens = 0.0, 0
        try:
            with torch.no_grad():
                for x, y in batches:
                    rows_x, rows_y = (
                        x[self.group.rank :: self.group.world],
                        y[self.group.rank :: self.group.world],
                    )
                    # FSDP gathers each block inside forward: every rank runs every batch, a
                    # rank without rows on a one-row stand-in whose loss it does not count.
                    counted = rows_x.shape[0] > 0
                    if not counted:
                        rows_x, rows_y = x[:1], y[:1]
                    xs, ys = rows_x.to(self.device), rows_y.to(self.device)
                    with autocast(self.device):
                        logits = model(xs)
                    if counted:
                        total += F.cross_entropy(
                            logits.float().view(-1, logits.shape[-1]), ys.reshape(-1),
                            reduction="sum",
                        ).item()  # fmt: skip
                        tokens += ys.numel()
        finally:
            model.train(was_training)
        sums = self.group.gather_floats([total, float(tokens)], "adding up the held-out loss")
        all_total = sum(s[0] for s in sums)
        all_tokens = sum(s[1] for s in sums)
        if all_tokens == 0:
            raise ValueError("evaluate() needs at least one non-empty batch")
        return all_total / all_tokens
