"""``sparseloco simulate``: SparseLoCo, DiLoCo and DDP side by side in one process.

N workers train the same model on disjoint streams of the same corpus with equal token budgets:
SparseLoCo and DiLoCo run R rounds of H inner steps per worker; DDP runs R*H steps whose
gradient is the mean over the N workers' batches (one batch of N times the size, which is the
same gradient). All three evaluate the global parameters on the same held-out split after every
round (every H steps for DDP) and report what one worker would have sent over the network:
the real encoded payload bytes for SparseLoCo, a dense fp32 pseudo-gradient per round for
DiLoCo, and a dense fp32 gradient per step for DDP.

SparseLoCo goes through the real codec path (``encode`` -> bytes -> ``read_payload`` ->
``apply_aggregate``), so the simulator measures what the network node will do.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from pydantic import Field, ValidationError, model_validator

from node.compute.data import open_corpus
from node.compute.model import LanguageModel, build_model, count_parameters, evaluate, get_preset
from node.compute.optim import InnerOptimConfig, inner_step, make_adamw
from node.compute.outer import (
    AggregateOptions,
    apply_aggregate,
    compress,
    feed_error,
    pseudo_gradient,
)
from node.compute.placement import resolve_device
from node.compute.presets import get_run_preset
from protocol.codec import read_payload
from protocol.errors import Problem, config_error
from protocol.fingerprint import fingerprint
from protocol.runconfig import RunConfig

log = logging.getLogger("sparseloco.simulate")

#: One worker's model and its inner optimiser.
Replica = tuple[LanguageModel, torch.optim.Optimizer]

#: An aggregate to merge during a round's training: (τ, the rows of step τ taken before it or
#: None for the whole step, per worker the step to subtract: θ_old - θ_new less the estimate it
#: started from, if any).
Merge = tuple[int, int | None, list[dict[str, torch.Tensor]]]

Algo = Literal["sparseloco", "diloco", "ddp"]

#: Inner learning rates by algorithm (DESIGN.md: 1e-3 SparseLoCo, 8e-4 DiLoCo, 3e-3-class DDP).
DEFAULT_INNER_LR: dict[str, float] = {"sparseloco": 1e-3, "diloco": 8e-4, "ddp": 3e-3}


class SimConfig(RunConfig):
    """Everything that determines a simulation; written into the result JSON.

    The run's own fields (model, H, rounds, batch, codec, outer and inner optimiser) are
    ``RunConfig``'s, with the same validation as a networked run; only what a simulation adds is
    declared here. Two defaults differ from a networked run's: the ``small`` model with batches
    of 12, the scale the CPU comparisons are made at. An absent ``inner_lr`` takes the
    algorithm's (``DEFAULT_INNER_LR``).
    """

    algo: Algo
    model: str = Field("small", min_length=1, max_length=32, pattern=r"^[a-z0-9_]+$")
    batch_size: int = Field(12, ge=1)
    workers: int = Field(4, ge=1)
    data: str | None = None
    # DiLoCo outer optimiser
    outer_lr: float = Field(0.7, gt=0.0)
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    # Evaluation
    eval_batches: int = Field(16, ge=1)
    eval_batch_size: int = Field(16, ge=1)
    #: Evaluate only before the first round and after the last (sweeps); False: every round.
    eval_final_only: bool = False
    #: Where the workers' inner steps run (``auto``, ``cpu``, ``cuda:N``). θ, the codec and the
    #: outer steps stay on the CPU in fp32, as on a node; evaluation runs on the device.
    device: str = "cpu"
    #: (overlap = "merge", simulator only: not built in the node daemon) Start each round from
    #: θ less eager's estimate of the aggregate in flight (``_eager_offsets``) instead of θ, and
    #: take the estimate back at the merge: the first τ steps are taken nearer θ_{r+1}, the
    #: pseudo-gradient is the same sum of inner steps (docs/benchmarks.md §12).
    merge_estimate: bool = False

    @model_validator(mode="before")
    @classmethod
    def _algorithm_lr(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("inner_lr") is None:
            values = {k: v for k, v in values.items() if k != "inner_lr"}
            if values.get("algo") in DEFAULT_INNER_LR:
                values["inner_lr"] = DEFAULT_INNER_LR[values["algo"]]
        return values

    @model_validator(mode="after")
    def _check_model(self) -> SimConfig:
        get_preset(self.model)  # raises ValueError listing the valid names
        if self.merge_estimate and self.overlap != "merge":
            raise ValueError(
                "merge_estimate (--merge-estimate) needs overlap = 'merge' (--overlap merge)"
            )
        return self

    @property
    def resolved_inner_lr(self) -> float:
        return self.inner_lr

    def inner_optim(self) -> InnerOptimConfig:
        return InnerOptimConfig(
            lr=self.inner_lr, warmup_steps=self.warmup_steps, total_steps=self.total_inner_steps
        )


def build_config(preset: str | None, **options: Any) -> SimConfig:
    """A ``SimConfig`` from a run preset plus explicit options (``None`` values are ignored)."""
    values: dict[str, Any] = {}
    if preset is not None:
        values.update(get_run_preset(preset).values())
    values.update({k: v for k, v in options.items() if v is not None})
    try:
        return SimConfig(**values)
    except ValidationError as exc:
        raise config_error(exc, _flag) from exc


def _flag(problem: Problem) -> str:
    if not problem.loc:
        return problem.message
    return "--" + "-".join(str(p) for p in problem.loc).replace("_", "-") + f": {problem.message}"


class Simulation:
    """State shared by the three algorithms: data, global model, evaluation."""

    def __init__(self, cfg: SimConfig, progress: Callable[[int, float], None] | None = None):
        self.cfg = cfg
        self.model_cfg = get_preset(cfg.model)
        self.corpus = open_corpus(
            cfg.data, ctx_len=self.model_cfg.ctx_len, vocab_size=self.model_cfg.vocab_size
        )
        self.eval_set = self.corpus.eval_batches(cfg.eval_batches, cfg.eval_batch_size)
        self.global_model = build_model(self.model_cfg, seed=cfg.seed)
        self.device = resolve_device(cfg.device)
        #: A device copy of θ for evaluation (None on the CPU: θ's own model is used).
        self.eval_model: LanguageModel | None = None
        self.optim_cfg = cfg.inner_optim()
        self.progress = progress
        self.curve: list[list[float]] = []
        self.train_curve: list[list[float]] = []

    def params(self, model: LanguageModel) -> dict[str, torch.Tensor]:
        return {n: p.data for n, p in model.named_parameters()}

    def host_params(self, model: LanguageModel) -> dict[str, torch.Tensor]:
        """A worker's parameters on the CPU (the same tensors when it trains there)."""
        return {n: p.data.to("cpu") for n, p in model.named_parameters()}

    def evaluate(self) -> float:
        """The held-out loss of θ, on the training device."""
        model = self.global_model
        if next(model.parameters()).device != self.device:
            if self.eval_model is None:
                self.eval_model = copy.deepcopy(model).to(self.device)
            _sync([(self.eval_model, None)], self.params(model))
            model = self.eval_model
        return evaluate(model, self.eval_set)

    def batch(self, worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.corpus.train_batch(
            worker=worker,
            n_workers=self.cfg.workers,
            step=step,
            batch_size=self.cfg.batch_size,
            seed=self.cfg.seed,
        )

    def record(self, round_: int, train_loss: float | None) -> float | None:
        if train_loss is not None:
            self.train_curve.append([round_, train_loss])
        if self.cfg.eval_final_only and 0 < round_ < self.cfg.rounds:
            return None
        loss = self.evaluate()
        self.curve.append([round_, loss])
        if self.progress:
            self.progress(round_, loss)
        return loss

    def train_workers(
        self, workers: list[Replica], round_: int, merge: Merge | None = None
    ) -> float:
        """H inner steps on every worker from its current parameters; mean last-step loss.

        ``merge`` = (τ, rows, steps): after τ inner steps (or inside step τ, after the
        gradients of its first ``rows`` rows) worker w subtracts ``steps[w]`` (θ_old - θ_new,
        the aggregate that arrived, less the estimate it started from) from its parameters, as
        ``Worker.merge`` does."""
        losses = []
        H = self.cfg.inner_steps
        for w, (model, opt) in enumerate(workers):
            for h in range(H):
                step = round_ * H + h
                x, y = self.batch(w, step)
                at = merge is not None and h + 1 == merge[0]
                pause = None
                if at and merge[1] is not None:  # type: ignore[index]
                    pause = (merge[1], lambda m=model, s=merge[2][w]: merge_into(m, s))  # type: ignore[index]
                loss = inner_step(model, opt, x, y, step=step, cfg=self.optim_cfg, pause=pause)
                if at and pause is None:
                    merge_into(model, merge[2][w])  # type: ignore[index]
            losses.append(loss)
        return sum(losses) / len(losses)

    def replicas(self) -> list[Replica]:
        out: list[Replica] = []
        for _ in range(self.cfg.workers):
            m = build_model(self.model_cfg, seed=self.cfg.seed).to(self.device)
            out.append((m, make_adamw(m, self.optim_cfg)))
        return out


def merge_into(model: LanguageModel, step: dict[str, torch.Tensor]) -> None:
    """θ_local ← θ_local - (θ_old - θ_new): the daemon's merge (``node.compute.merge``)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.sub_(step[n].to(p.device))


def _sync(workers: Sequence[tuple[LanguageModel, Any]], theta: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for model, _ in workers:
            for n, p in model.named_parameters():
                p.copy_(theta[n])


def run_sparseloco(sim: Simulation) -> dict[str, Any]:
    cfg = sim.cfg
    step = AggregateOptions(alpha=cfg.alpha, clip=cfg.clip, robust=cfg.robust)
    theta = sim.params(sim.global_model)
    workers = sim.replicas()
    errors = [{n: torch.zeros_like(t) for n, t in theta.items()} for _ in workers]
    shapes = {n: tuple(t.shape) for n, t in theta.items()}
    sent = 0
    in_flight: dict[str, Any] | None = None  # with overlap: the aggregate still travelling
    offsets: list[dict[str, torch.Tensor] | None] = [None] * len(workers)  # eager: start - θ
    sim.record(0, None)
    for r in range(cfg.rounds):
        for worker, offset in zip(workers, offsets, strict=True):
            start = theta if offset is None else {n: theta[n] - offset[n] for n in theta}
            _sync([worker], start)
        merge = None
        if cfg.merge_step is not None and in_flight is not None:
            # Round r-1's aggregate arrives while round r trains: θ moves now (the workers
            # started from the θ before, less their estimate if any), and each worker takes
            # the step at inner step τ, less the estimate it already took.
            old = {n: t.clone() for n, t in theta.items()}
            apply_aggregate(theta, in_flight, step)
            taken = {n: old[n] - theta[n] for n in theta}
            steps = [taken if o is None else {n: taken[n] - o[n] for n in theta} for o in offsets]
            merge = (cfg.merge_step, cfg.merge_rows, steps)
            in_flight = None
        base = fingerprint(theta)
        train_loss = sim.train_workers(workers, r, merge)
        payloads, recons = {}, []
        for w, (model, _) in enumerate(workers):
            delta = pseudo_gradient(theta, sim.host_params(model))
            if offsets[w] is not None and merge is None:  # (a merge took the estimate back)
                for n, d in delta.items():
                    d.sub_(offsets[w][n])  # type: ignore[index]
            feed_error(errors[w], delta, cfg.beta)
            data, recon = compress(
                errors[w], topk=cfg.topk, tile=cfg.tile, round=r, node_id=f"w{w:03d}", base=base
            )
            sent += len(data)
            recons.append(recon)
            payloads[f"w{w:03d}"] = read_payload(data, shapes, topk=cfg.topk, tile=cfg.tile)
        if not cfg.overlaps:
            apply_aggregate(theta, payloads, step)
        else:
            # Round r-1's aggregate travelled while round r trained: it is applied now. The
            # last round's own aggregate follows at once (nothing trains after it).
            last = r == cfg.rounds - 1
            before = {n: t.clone() for n, t in theta.items()} if in_flight else None
            for due in (in_flight, payloads if last else None):
                if due is not None:
                    apply_aggregate(theta, due, step)
            if cfg.overlap == "eager" and before is not None and in_flight and not last:
                offsets = _eager_offsets(before, theta, len(in_flight), recons, cfg.alpha)
            elif cfg.merge_estimate and merge is not None and not last:
                # The next round starts from θ less the estimate of this round's aggregate,
                # taken from the step the one merged in this round took.
                offsets = _eager_offsets(old, theta, len(payloads), recons, cfg.alpha)
            in_flight = None if last else payloads
        sim.record(r + 1, train_loss)
    return {"bytes_sent_per_worker": sent / cfg.workers}


def _eager_offsets(
    before: dict[str, torch.Tensor],
    theta: dict[str, torch.Tensor],
    peers: int,
    recons: list[dict[str, torch.Tensor]],
    alpha: float,
) -> list[dict[str, torch.Tensor] | None]:
    """Each worker's estimate of the aggregate in flight, as the daemon's
    ``Worker.eager_offset``: its own ĉ for a 1/G share, the last aggregate's step for the rest."""
    step = {n: before[n] - theta[n] for n in theta}
    return [
        {n: step[n] * ((peers - 1) / peers) + recon[n] * (alpha / peers) for n in theta}
        for recon in recons
    ]


def run_diloco(sim: Simulation) -> dict[str, Any]:
    cfg = sim.cfg
    theta = sim.params(sim.global_model)
    workers = sim.replicas()
    outer = torch.optim.SGD(
        sim.global_model.parameters(),
        lr=cfg.outer_lr,
        momentum=cfg.outer_momentum,
        nesterov=cfg.outer_momentum > 0,
    )
    n_params = count_parameters(sim.global_model)
    sim.record(0, None)
    for r in range(cfg.rounds):
        _sync(workers, theta)
        train_loss = sim.train_workers(workers, r)
        trained = [sim.host_params(m) for m, _ in workers]
        for n, p in sim.global_model.named_parameters():
            deltas = [theta[n] - t[n] for t in trained]
            p.grad = torch.stack(deltas).mean(0)
        outer.step()
        outer.zero_grad(set_to_none=True)
        sim.record(r + 1, train_loss)
    return {"bytes_sent_per_worker": 4 * n_params * cfg.rounds}


def run_ddp(sim: Simulation) -> dict[str, Any]:
    cfg = sim.cfg
    model = sim.global_model.to(sim.device)  # DDP's one model is θ: it lives on the device
    opt = make_adamw(model, sim.optim_cfg)
    H = cfg.inner_steps
    sim.record(0, None)
    for r in range(cfg.rounds):
        for h in range(H):
            step = r * H + h
            batches = [sim.batch(w, step) for w in range(cfg.workers)]
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            # Mean loss over equal-sized worker batches = the mean of the workers' gradients.
            loss = inner_step(model, opt, x, y, step=step, cfg=sim.optim_cfg)
        sim.record(r + 1, loss)
    return {"bytes_sent_per_worker": 4 * count_parameters(model) * cfg.rounds * H}


RUNNERS: dict[str, Callable[[Simulation], dict[str, Any]]] = {
    "sparseloco": run_sparseloco,
    "diloco": run_diloco,
    "ddp": run_ddp,
}


def simulate(
    cfg: SimConfig, progress: Callable[[int, float], None] | None = None
) -> dict[str, Any]:
    """Run one simulation and return the result document (see module docstring)."""
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    sim = Simulation(cfg, progress)
    extra = RUNNERS[cfg.algo](sim)
    wall = time.perf_counter() - start
    tokens = cfg.rounds * cfg.inner_steps * cfg.batch_size * sim.model_cfg.ctx_len
    sent = extra["bytes_sent_per_worker"]
    return {
        "algo": cfg.algo,
        "final_eval_loss": sim.curve[-1][1],
        "eval_loss_curve": sim.curve,
        "train_loss_curve": sim.train_curve,
        "bytes_sent_per_worker": sent,
        "bytes_per_round_per_worker": sent / cfg.rounds,
        "tokens_per_worker": tokens,
        "parameters": count_parameters(sim.global_model),
        "wall_seconds": wall,
        "final_fingerprint": fingerprint(sim.host_params(sim.global_model)),
        "config": {
            **cfg.model_dump(),
            "inner_lr": cfg.resolved_inner_lr,
            "model_config": sim.model_cfg.model_dump(),
        },
    }
