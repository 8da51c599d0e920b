"""One process's share of a node: what it holds between rounds, and that held state in and out.

A ``Share`` owns the model, θ, the error-feedback buffer e, AdamW, the data stream and the
evaluation batches; it takes a snapshot of them for the state files (``node.compute.state``),
restores one, and resets θ for a replay, a checkpoint or a test. The steps of a round that
change them (train, compress, read, apply) are ``node.compute.worker.Worker``, built on top.

**One process or several.** A share is one process's part of a node (``group``: its rank of the
node's ``world``). With one process it holds the whole model and θ *is* the model's
parameters. Under torchrun every rank builds one and the ranks call the same methods in the
same order (``node.daemon.ops`` sees to that): each owns some whole tensors
(``node.compute.sharding``) and holds θ and e for those only, on its own device; the inner steps
run on FSDP2 over all ranks (``node.compute.fsdp``); the few cross-rank results (sums,
digests) are agreed through ``Group``. Per tensor the arithmetic is the single process's, so θ
is bit for bit the same whatever the rank count. θ and e of a single process stay on the CPU
whatever the training device (``node.compute.placement``), so nodes on any device stay
bit-identical.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from node.compute.data import Corpus, open_corpus
from node.compute.files import Writes
from node.compute.fsdp import ShardedPlacement
from node.compute.group import Group
from node.compute.inner import InnerLoop
from node.compute.mass import total
from node.compute.model import build_model, get_preset, initial_tensors, model_shapes
from node.compute.optim import InnerOptimConfig, adam_tensors, make_adamw, restore_adam
from node.compute.placement import Placement, resolve_device
from node.compute.sharding import assign
from node.compute.shards import node_fingerprint
from node.compute.state import NodeState
from protocol.fingerprint import fingerprint
from protocol.runconfig import RunConfig


def _rank_device(spec: str | torch.device, group: Group) -> torch.device:
    """Where a rank keeps its tensors: its own GPU (``LOCAL_RANK``) when the node trains on
    CUDA under torchrun, else the device asked for."""
    device = resolve_device(spec)
    if device.type == "cuda" and group.distributed:
        return torch.device("cuda", group.local_rank)
    return device


class Share:
    """One process's share of a participant: model, optimiser, θ, error buffer and data."""

    def __init__(
        self,
        run: RunConfig,
        *,
        run_id: str,
        node_id: str,
        slot: int,
        data: str | Corpus | None = None,
        eval_batches: int = 4,
        eval_batch_size: int = 8,
        device: str | torch.device = "cpu",
        separate: bool = False,
        group: Group | None = None,
    ) -> None:
        """``device``: where the inner steps run (``auto``, ``cpu``, ``cuda:N``); ``separate``
        trains in a copy of the model even on the CPU (the device path, for tests); ``group``:
        this process's rank of the node (one process by default)."""
        self.run = run
        self.run_id = run_id
        self.node_id = node_id
        self.slot = slot
        self.group = group or Group.solo()
        self.model_cfg = get_preset(run.model)
        #: Every tensor of the model (what a payload must hold), and the ones this rank owns.
        self.shapes = model_shapes(self.model_cfg)
        self.owners = assign(self.shapes, self.group.world)
        self.owned = [n for n in sorted(self.shapes) if self.owners[n] == self.group.rank]
        self.corpus = open_corpus(
            data, ctx_len=self.model_cfg.ctx_len, vocab_size=self.model_cfg.vocab_size
        )
        self.eval_set = self.corpus.eval_batches(eval_batches, eval_batch_size)
        self.optim_cfg = InnerOptimConfig(
            lr=run.inner_lr,
            warmup_steps=run.warmup_steps,
            total_steps=run.total_inner_steps,
        )
        self.device = _rank_device(device, self.group)
        #: Under torchrun (any number of processes): θ and e on this rank's device, the
        #: inner steps on FSDP. A plain process keeps θ in the model, on the CPU.
        self.sharded = self.group.distributed
        self.theta: dict[str, torch.Tensor] = {}
        self.placement: Placement | ShardedPlacement
        if not self.sharded:
            self.model = build_model(self.model_cfg, seed=run.seed)
            self.placement = Placement(self.model, self.device, separate=separate)
        else:
            initial = initial_tensors(self.model_cfg, seed=run.seed, names=self.owned)
            self.theta = {n: t.to(self.device) for n, t in initial.items()}
            self.placement = ShardedPlacement(
                self.model_cfg, self.group, self.device, self.owners, self.theta
            )
            self.model = self.placement.train_model
        train_model = self.placement.train_model
        self.opt = make_adamw(train_model, self.optim_cfg)
        self.inner = InnerLoop(
            run, train_model, self.opt, self.optim_cfg, self.corpus, slot, group=self.group
        )
        self.error = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.round = 0
        self.local_steps = 0
        self.stop = threading.Event()
        #: Fingerprint of θ as it is now; None once θ changed (see ``fingerprint``).
        self._fingerprint: str | None = None
        #: Fingerprint of θ before the last aggregate was applied, if it was known then: under
        #: overlap, the base of the round the node applies next.
        self.previous_fingerprint: str | None = None
        #: (eager overlap) The step the last aggregate took, α·A, and how many peers it had.
        self.last_step: dict[str, torch.Tensor] | None = None
        self.last_gathered = 0
        #: Files of the local state being written behind (``node.compute.state``): every method
        #: that changes θ waits for θ's, training waits for AdamW's.
        self.writes = Writes()

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """θ: this rank's tensors (all of them in a single process, the model's own memory)."""
        if isinstance(self.placement, Placement):
            return self.placement.theta()
        return self.theta

    @property
    def owned_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: self.shapes[n] for n in self.owned}

    def node_sum(self, value: float) -> float:
        """A float64 sum over the node's ranks, in rank order (the same on every rank)."""
        return sum(v[0] for v in self.group.gather_floats([value]))

    def fingerprint(self) -> str:
        """Fingerprint of θ, computed once per value of θ (every change of θ forgets it); on a
        node of several ranks each hashes its own tensors and the digests are combined."""
        if self._fingerprint is None:
            if not self.sharded:
                self._fingerprint = fingerprint(self.params)
            else:
                self._fingerprint = node_fingerprint(self.group, self.params)
        return self._fingerprint

    def held_mass(self) -> float:
        """Σe over the node: what it keeps for later rounds."""
        return self.node_sum(total(self.error))

    def evaluate(self) -> float:
        return self.placement.evaluate(self.eval_set)

    # -- the state in and out ------------------------------------------------------------------

    def snapshot(self, phase: str = "idle", seq: int = 0) -> NodeState:
        return NodeState(
            run_id=self.run_id,
            node_id=self.node_id,
            round=self.round,
            theta=self.params,
            error=self.error,
            adam=adam_tensors(self.opt),
            local_steps=self.local_steps,
            phase=phase,  # type: ignore[arg-type]
            fingerprint=self.fingerprint(),
            world=self.group.world,
            seq=seq,
        )

    def restore(self, state: NodeState) -> None:
        self.writes.wait()
        self.start_at(state.theta, state.round)
        with torch.no_grad():
            for name, e in self.error.items():
                e.copy_(state.error[name])
        if state.adam:
            restore_adam(self.opt, state.adam)
        self.local_steps = state.local_steps

    def start_at(
        self, theta: Mapping[str, torch.Tensor], round_: int, fp: str | None = None
    ) -> None:
        """θ and round where a restart, a checkpoint or a replay from θ_0 puts the node
        (``fp``: θ's fingerprint, if known); no aggregate before it is known."""
        self._reset_to(theta, fp)
        self.round = round_
        self.previous_fingerprint = None
        self.last_step = None

    def reset_to_initial(self) -> None:
        """θ_0 from the run's seed, round 0 (for a replay from the start)."""
        if not self.sharded:
            initial = build_model(self.model_cfg, seed=self.run.seed)
            theta = {n: p.data for n, p in initial.named_parameters()}
        else:
            theta = initial_tensors(self.model_cfg, seed=self.run.seed, names=self.owned)
        self.start_at(theta, 0)

    def reset_theta(self, theta: Mapping[str, torch.Tensor], fp: str | None = None) -> None:
        """Set θ to ``theta`` (``fp``: its fingerprint, if known). The round loop never sets θ
        but through its steps; the tests' stale node (``tests/support/hostile.py``) and
        diverging node (``tests/support/diverge.py``) do."""
        self._reset_to(theta, fp)

    def _reset_to(self, theta: Mapping[str, torch.Tensor], fp: str | None = None) -> None:
        """Set θ; ``fp`` is its fingerprint when the caller knows it (else computed on demand)."""
        self.writes.theta.wait()
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(theta[name])
        self._fingerprint = fp
