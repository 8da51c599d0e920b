"""The inner steps of a node of several ranks: torch's FSDP2 over the node's processes.

Under ``torchrun`` the model the H inner steps train is wrapped with
``torch.distributed.fsdp.fully_shard``, each transformer block first, then the root: every rank
holds a dim-0 chunk of every parameter (FSDP's own layout), one AdamW steps over those chunks,
and a forward or backward gathers one block's parameters at a time. On CUDA the blocks compute
in bf16 with fp32 master weights and gradient reductions in fp32 (``MixedPrecisionPolicy``),
over NCCL; on the CPU everything stays fp32, over gloo.

The outer state is sharded differently (``node.compute.sharding``: whole tensors, one owner
each), so θ meets the FSDP chunks twice a round, one tensor at a time:

- ``begin``: each tensor's owner sends every rank the rows of its FSDP chunk of θ_r (or of
  θ_r - offset) in one ``all_to_all_single``: the model starts the round at θ_r;
- ``finish``: every rank sends its chunk of the trained tensor back to the owner, which forms
  the pseudo-gradient θ_r - θ_trained in its own memory.

Nothing here holds a whole model: a rank has its chunks, its own tensors and, for one tensor at a
time, the rows in flight. Evaluation runs the same FSDP model, each rank on its rows of every
held-out batch, the token-weighted sums added over the ranks.

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
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from node.compute.group import Group, phase
from node.compute.model import LanguageModel, ModelConfig, autocast, model_class


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
        for unit in model.units():
            fully_shard(unit, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        model.to_empty(device=device)
        model.reset_buffers()
        #: The model the inner steps train (its parameters are DTensors of FSDP chunks).
        self.train_model: LanguageModel = model
        self._params: dict[str, DTensor] = dict(model.named_parameters())  # type: ignore[arg-type]
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
        theta = self.theta
        with torch.no_grad(), phase("sending θ to the FSDP chunks"):
            for name in self.names:
                source = None
                if name in theta:
                    source = theta[name] if offset is None else torch.sub(theta[name], offset[name])
                self._scatter(name, source)

    def _scatter(self, name: str, source: Tensor | None) -> None:
        p = self._params[name]
        owner = self.owners[name]
        rows, cols = _rows_cols(tuple(p.shape))
        chunks = chunk_rows(rows, self.group.world)
        local = p.to_local()
        dev = local.device
        if self.group.rank == owner:
            if source is None:
                raise RuntimeError(f"rank {owner} owns {name} but has no θ for it")
            send = source.detach().reshape(-1).to(dev, torch.float32).contiguous()
            in_splits = [c * cols for c in chunks]
        else:
            send = torch.empty(0, dtype=torch.float32, device=dev)
            in_splits = [0] * self.group.world
        out_splits = [
            chunks[self.group.rank] * cols if q == owner else 0 for q in range(self.group.world)
        ]
        received = torch.empty(chunks[self.group.rank] * cols, dtype=torch.float32, device=dev)
        dist.all_to_all_single(received, send, out_splits, in_splits)
        local.copy_(received.view_as(local))

    def finish(self) -> dict[str, Tensor]:
        """The pseudo-gradient θ - θ_trained of the owned tensors, in fresh memory beside θ."""
        theta = self.theta
        delta: dict[str, Tensor] = {}
        with torch.no_grad(), phase("collecting the trained tensors"):
            for name in self.names:
                trained = self._gather(name)
                if trained is not None:
                    t = theta[name]
                    trained = trained.view(t.shape).to(t.device)
                    delta[name] = torch.sub(t, trained, out=trained)
        return delta

    def _gather(self, name: str) -> Tensor | None:
        p = self._params[name]
        owner = self.owners[name]
        rows, cols = _rows_cols(tuple(p.shape))
        chunks = chunk_rows(rows, self.group.world)
        local = p.to_local().detach().reshape(-1).to(torch.float32).contiguous()
        in_splits = [local.numel() if q == owner else 0 for q in range(self.group.world)]
        if self.group.rank == owner:
            out_splits = [c * cols for c in chunks]
            received = torch.empty(rows * cols, dtype=torch.float32, device=local.device)
        else:
            out_splits = [0] * self.group.world
            received = torch.empty(0, dtype=torch.float32, device=local.device)
        dist.all_to_all_single(received, local, out_splits, in_splits)
        return received if self.group.rank == owner else None

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
