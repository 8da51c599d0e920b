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

**Unequal workers** (SparseLoCo only; docs/benchmarks.md §18): a speed and a link time per
worker (``speeds``, ``link``), a round ``schedule`` and a wall time in step units (``wall``,
default rounds × H), as ``node.research.timeplan`` models them; the run is as many rounds as
fit in the wall time (``at_equal_wall``), and the learning-rate schedule spans them. Worker w's
inner step h of round r is global step r·H + h whatever its count: the schedule follows the
round.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from pydantic import Field, ValidationError, field_validator, model_validator

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
from node.compute.work import peer_weights
from node.research.timeplan import RoundPlan, Schedule, plan_round
from protocol.codec import Payload, read_payload
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


def _numbers(value: Any) -> Any:
    """A comma-separated flag value (``1,1,1,0.333``) as its numbers; other values unchanged."""
    if not isinstance(value, str):
        return value
    try:
        return [float(w) for w in value.split(",") if w.strip()]
    except ValueError:
        raise ValueError(
            f"expected comma-separated numbers such as 1,1,1,0.333, got {value!r}"
        ) from None


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
    # Unequal workers (SparseLoCo; module docstring, docs/benchmarks.md §18)
    #: One relative speed per worker (a speed-1 worker takes one step unit per inner step);
    #: None: all 1.
    speeds: list[float] | None = None
    #: Per worker, a round's transfers (upload and download, not overlapping its training) in
    #: step units; None: all 0.
    link: list[float] | None = None
    #: How a round treats unequal workers (``plan_round``): wait, leave_out, budget, batch.
    schedule: Schedule = "wait"
    #: The run's wall time in step units; None: rounds × H (a speed-1 fleet's). With unequal
    #: workers the run is as many rounds as fit in it (``at_equal_wall``).
    wall: float | None = Field(None, gt=0, allow_inf_nan=False)

    @field_validator("speeds", "link", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return _numbers(value)

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
        for name, values in (("speeds", self.speeds), ("link", self.link)):
            if values is None:
                continue
            if len(values) != self.workers:
                raise ValueError(
                    f"--{name} has {len(values)} values for {self.workers} workers: give one per"
                    f" worker (or set --workers {len(values)})"
                )
            # A step takes 1/speed, so a speed must be above 0; a link time may be 0.
            positive = name == "speeds"
            for w, v in enumerate(values):
                if not (math.isfinite(v) and (v > 0 if positive else v >= 0)):
                    need = "above 0" if positive else "0 or more"
                    raise ValueError(
                        f"--{name}: every value must be {need}, got {v:g} (worker {w})"
                    )
        if self.unequal:
            if self.algo != "sparseloco":
                raise ValueError(
                    f"--speeds, --link, --schedule and --wall model unequal workers for"
                    f" SparseLoCo only; drop them for --algo {self.algo}"
                )
            if self.overlaps:
                raise ValueError(
                    "--speeds, --link, --schedule and --wall time rounds without overlap; drop"
                    f" --overlap {self.overlap}"
                )
            self.round_plan()  # a budget that leaves everyone out fails here, not mid-run
        return self

    @property
    def unequal(self) -> bool:
        """Whether the run uses the model of unequal workers (any of its options is set)."""
        given = (self.speeds, self.link, self.wall)
        return any(v is not None for v in given) or self.schedule != "wait"

    @property
    def worker_speeds(self) -> list[float]:
        return list(self.speeds) if self.speeds is not None else [1.0] * self.workers

    @property
    def worker_link(self) -> list[float]:
        return list(self.link) if self.link is not None else [0.0] * self.workers

    def round_plan(self) -> RoundPlan:
        """Each worker's steps, rows and work per round, and the round's wall time."""
        return plan_round(
            inner_steps=self.inner_steps,
            batch_size=self.batch_size,
            speeds=self.worker_speeds,
            link=self.worker_link,
            schedule=self.schedule,
            budget=self.timing.budget,
        )

    @property
    def resolved_inner_lr(self) -> float:
        return self.inner_lr

    def inner_optim(self) -> InnerOptimConfig:
        return InnerOptimConfig(
            lr=self.inner_lr, warmup_steps=self.warmup_steps, total_steps=self.total_inner_steps
        )


def build_config(preset: str | None, **options: Any) -> SimConfig:
    """A ``SimConfig`` from a run preset plus explicit options (``None`` values are ignored),
    at equal wall time (``at_equal_wall``). ``budget`` is ``timing.budget`` ("median",
    "fastest", "off", or step units, as a number or its text)."""
    values: dict[str, Any] = {}
    if preset is not None:
        values.update(get_run_preset(preset).values())
    values.update({k: v for k, v in options.items() if v is not None})
    if "budget" in values:
        values["timing"] = {
            **dict(values.get("timing") or {}),
            "budget": _budget(values.pop("budget")),
        }
    try:
        return at_equal_wall(SimConfig(**values))
    except ValidationError as exc:
        raise config_error(exc, _flag) from exc


def at_equal_wall(cfg: SimConfig) -> SimConfig:
    """``cfg`` with as many rounds as fit in its wall time (``wall``, default rounds × H) under
    its plan of unequal workers, and ``wall`` set; ``cfg`` itself when it has no unequal
    workers. Idempotent: the round's wall time does not depend on the rounds."""
    if not cfg.unequal:
        return cfg
    wall = cfg.wall if cfg.wall is not None else float(cfg.rounds * cfg.inner_steps)
    rounds = cfg.round_plan().rounds_in(wall)
    if (rounds, wall) == (cfg.rounds, cfg.wall):
        return cfg
    return SimConfig(**{**cfg.model_dump(), "rounds": rounds, "wall": wall})


def _budget(value: Any) -> Any:
    """``--budget``'s text as ``Timing.budget`` takes it: a name, or a number of step units."""
    if isinstance(value, str) and value not in ("median", "fastest", "off"):
        try:
            return float(value)
        except ValueError:
            return value  # Timing's own message names the choices
    return value


def _flag(problem: Problem) -> str:
    if not problem.loc:
        return problem.message
    if problem.loc[:2] == ("timing", "budget"):
        return f"--budget: {problem.message}"
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
        #: What each worker does in every round (all alike but for unequal workers).
        self.plan = cfg.round_plan()
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
        """Each worker's inner steps of the round from its current parameters (``plan``: H of
        the whole batch, but for unequal workers); the mean last-step loss of those that trained.

        ``merge`` = (τ, rows, steps): after τ inner steps (or inside step τ, after the
        gradients of its first ``rows`` rows) worker w subtracts ``steps[w]`` (θ_old - θ_new,
        the aggregate that arrived, less the estimate it started from) from its parameters, as
        ``Worker.merge`` does."""
        losses = []
        H = self.cfg.inner_steps
        for w, (model, opt) in enumerate(workers):
            rows = self.plan.rows[w]
            for h in range(self.plan.steps[w]):
                step = round_ * H + h
                x, y = self.batch(w, step)
                if rows < len(x):  # ``batch``: the first rows of the stream's batch
                    x, y = x[:rows], y[:rows]
                at = merge is not None and h + 1 == merge[0]
                pause = None
                if at and merge[1] is not None:  # type: ignore[index]
                    pause = (merge[1], lambda m=model, s=merge[2][w]: merge_into(m, s))  # type: ignore[index]
                loss = inner_step(model, opt, x, y, step=step, cfg=self.optim_cfg, pause=pause)
                if at and pause is None:
                    merge_into(model, merge[2][w])  # type: ignore[index]
            if self.plan.steps[w]:
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
    plan, ctx_len = sim.plan, sim.model_cfg.ctx_len
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
            _aggregate(theta, in_flight, step, cfg)
            taken = {n: old[n] - theta[n] for n in theta}
            steps = [taken if o is None else {n: taken[n] - o[n] for n in theta} for o in offsets]
            merge = (cfg.merge_step, cfg.merge_rows, steps)
            in_flight = None
        base = fingerprint(theta)
        train_loss = sim.train_workers(workers, r, merge)
        payloads, recons = {}, []
        for w, (model, _) in enumerate(workers):
            if not plan.steps[w]:
                continue  # left out of the round: nothing sent, its error buffer untouched
            delta = pseudo_gradient(theta, sim.host_params(model))
            if offsets[w] is not None and merge is None:  # (a merge took the estimate back)
                for n, d in delta.items():
                    d.sub_(offsets[w][n])  # type: ignore[index]
            feed_error(errors[w], delta, cfg.beta)
            data, recon = compress(
                errors[w],
                topk=cfg.topk,
                tile=cfg.tile,
                round=r,
                node_id=f"w{w:03d}",
                base=base,
                steps=plan.work[w],
                tokens=plan.steps[w] * plan.rows[w] * ctx_len,
            )
            sent += len(data)
            recons.append(recon)
            payloads[f"w{w:03d}"] = read_payload(data, shapes, topk=cfg.topk, tile=cfg.tile)
        if not cfg.overlaps:
            _aggregate(theta, payloads, step, cfg)
        else:
            # Round r-1's aggregate travelled while round r trained: it is applied now. The
            # last round's own aggregate follows at once (nothing trains after it).
            last = r == cfg.rounds - 1
            before = {n: t.clone() for n, t in theta.items()} if in_flight else None
            for due in (in_flight, payloads if last else None):
                if due is not None:
                    _aggregate(theta, due, step, cfg)
            if cfg.overlap == "eager" and before is not None and in_flight and not last:
                offsets = _eager_offsets(before, theta, len(in_flight), recons, cfg.alpha)
            elif cfg.merge_estimate and merge is not None and not last:
                # The next round starts from θ less the estimate of this round's aggregate,
                # taken from the step the one merged in this round took.
                offsets = _eager_offsets(old, theta, len(payloads), recons, cfg.alpha)
            in_flight = None if last else payloads
        sim.record(r + 1, train_loss)
    return {"bytes_sent_per_worker": sent / cfg.workers}


def _aggregate(
    theta: dict[str, torch.Tensor],
    payloads: Mapping[str, Payload],
    options: AggregateOptions,
    cfg: SimConfig,
) -> None:
    """``apply_aggregate``, each payload weighted by the steps its header says it carries under
    the run's ``work_weight``, as a node weighs them (equal steps: unweighted, bit for bit)."""
    steps = {n: p.steps for n, p in payloads.items()}
    apply_aggregate(theta, payloads, options, peer_weights(steps, cfg.inner_steps, cfg.work_weight))


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
    cfg = at_equal_wall(cfg)
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    sim = Simulation(cfg, progress)
    extra = RUNNERS[cfg.algo](sim)
    wall = time.perf_counter() - start
    plan = sim.plan
    tokens = [
        cfg.rounds * s * b * sim.model_cfg.ctx_len
        for s, b in zip(plan.steps, plan.rows, strict=True)
    ]
    sent = extra["bytes_sent_per_worker"]
    return {
        "algo": cfg.algo,
        "final_eval_loss": sim.curve[-1][1],
        "eval_loss_curve": sim.curve,
        "train_loss_curve": sim.train_curve,
        "bytes_sent_per_worker": sent,
        "bytes_per_round_per_worker": sent / cfg.rounds,
        "tokens_per_worker": statistics.mean(tokens),
        # The model of time (step units; module docstring): the same plan every round.
        "schedule": cfg.schedule,
        "speeds": cfg.worker_speeds,
        "link": cfg.worker_link,
        "wall": cfg.wall if cfg.wall is not None else float(cfg.rounds * cfg.inner_steps),
        "rounds_run": cfg.rounds,
        "round_wall": plan.wall,
        "round_budget": plan.budget,
        "steps": list(plan.steps),
        "batch_rows": list(plan.rows),
        "work_steps": list(plan.work),
        "tokens": tokens,
        "parameters": count_parameters(sim.global_model),
        "wall_seconds": wall,
        "final_fingerprint": fingerprint(sim.host_params(sim.global_model)),
        "config": {
            **cfg.model_dump(),
            "inner_lr": cfg.resolved_inner_lr,
            "model_config": sim.model_cfg.model_dump(),
        },
    }
