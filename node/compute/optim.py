"""The inner optimiser: AdamW with the published SparseLoCo settings and its learning-rate schedule.

Each node runs H inner steps of AdamW between synchronisations; the AdamW state stays on the node
across rounds and is never shared. Defaults are the paper's: lr 1e-3, betas (0.9, 0.95), eps 1e-8,
weight decay 0.1 on matrices only, gradient-norm clip 1.0, linear warm-up from 0.1x then cosine
decay to 0.1x.

The schedule is indexed by the **global** inner step (round x H + local step), never by a per-round
or per-process counter: a node that joins late or restarts must land on the same learning rate as
everyone else (schedule drift after restarts was a recurring bug in the production system).

The moments themselves go to the node's state files as a flat name -> tensor map
(``adam_tensors``, ``restore_adam``), the same on any device and under FSDP.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from torch import Tensor

from node.compute.model import LanguageModel, autocast
from protocol.bounds import Count, Fraction, Natural, NonNegative, Positive


class InnerOptimConfig(BaseModel):
    """AdamW hyper-parameters and the warm-up + cosine schedule, in global inner steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: Positive = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: Positive = 1e-8
    weight_decay: NonNegative = 0.1
    grad_clip: Positive = 1.0
    warmup_steps: Natural
    total_steps: Count
    start_ratio: Fraction = 0.1
    final_ratio: Fraction = 0.1

    @model_validator(mode="after")
    def _check(self) -> InnerOptimConfig:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(
                f"betas={self.betas} must both lie in [0, 1); the default is (0.9, 0.95)"
            )
        if self.warmup_steps > self.total_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps};"
                " lower warmup_steps or raise total_steps"
            )
        return self


def lr_at(step: int, cfg: InnerOptimConfig) -> float:
    """Learning rate at global inner step ``step``.

    Linear from ``start_ratio * lr`` at step 0 to ``lr`` at ``warmup_steps``, then cosine down to
    ``final_ratio * lr`` at ``total_steps``, and constant at that value afterwards.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step >= cfg.total_steps:
        return cfg.lr * cfg.final_ratio
    if step < cfg.warmup_steps:
        frac = step / cfg.warmup_steps
        return cfg.lr * (cfg.start_ratio + (1.0 - cfg.start_ratio) * frac)
    progress = (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.final_ratio + (1.0 - cfg.final_ratio) * cosine)


def make_adamw(model: torch.nn.Module, cfg: InnerOptimConfig) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters, decaying 2-D weights only.

    Norm gains (1-D) are not decayed: pulling them towards 0 only fights the normalisation. The
    group order (decayed, then not) and the parameter order inside each group follow
    ``named_parameters``, so the state layout is the same on every node. On CUDA the fused
    kernel runs (one launch for all parameters); on the CPU the default implementation, whose
    bytes the tests pin.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    on_cuda = bool(params) and all(p.is_cuda for p in params)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=lr_at(0, cfg),
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=True if on_cuda else None,  # None: torch's default, as before
    )


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group of ``opt``."""
    for group in opt.param_groups:
        group["lr"] = lr


def inner_step(
    model: LanguageModel,
    opt: torch.optim.Optimizer,
    x: Tensor,
    y: Tensor,
    *,
    step: int,
    cfg: InnerOptimConfig,
    lr_scale: float = 1.0,
    weight: float = 1.0,
    node_loss: Callable[[Tensor], float] | None = None,
    pause: tuple[int, Callable[[], None]] | None = None,
) -> float:
    """One inner training step at global step ``step``; returns the batch loss in nats.

    Sets the scheduled learning rate (times ``lr_scale``, the re-warm-up factor of a node whose
    AdamW state is fresh mid-run), runs forward (bf16 autocast on CUDA) and backward, clips the
    global gradient norm to ``cfg.grad_clip``, steps and clears the gradients. A non-finite loss
    raises ``FloatingPointError`` before the step, so a diverged batch never poisons the weights
    or the AdamW moments.

    On a rank of a node of several processes (FSDP, ``node.compute.inner``) ``x`` and ``y`` are
    this rank's rows of the node's batch: ``weight`` scales its loss before backward so that
    FSDP's averaged gradient is the gradient of the node's whole batch (rows of unequal count
    weigh what they hold), and ``node_loss`` turns the rank's loss into the node's (the same
    value on every rank, so all of them take the same branch at the finiteness check).

    ``pause`` = (rows, fn) (overlap "merge" inside a step): the gradient of the first ``rows``
    rows is taken, ``fn`` runs (it may move the parameters), then the gradient of the other
    rows is added at the parameters as they are now, each part weighted by its share of the
    batch, and the step is taken from there: the same mean-loss gradient as one pass when
    ``fn`` changes nothing.
    """
    device = next(model.parameters()).device
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    set_lr(opt, lr_at(step, cfg) * lr_scale)
    if pause is None:
        with autocast(device):
            loss = model.loss(x, y)
        (loss if weight == 1.0 else loss * weight).backward()
    else:
        try:
            loss = _split_backward(model, x, y, weight, *pause)
        except BaseException:
            # (the merge was abandoned) No half-batch gradient is left for the next step.
            opt.zero_grad(set_to_none=True)
            raise
    value = node_loss(loss) if node_loss is not None else loss.item()
    if not math.isfinite(value):
        opt.zero_grad(set_to_none=True)
        raise FloatingPointError(f"non-finite training loss {value} at inner step {step}")
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return value


def _split_backward(
    model: LanguageModel, x: Tensor, y: Tensor, weight: float, rows: int, fn: Callable[[], None]
) -> Tensor:
    """The gradients of rows ``:rows`` and ``rows:`` of the batch with ``fn`` run between them;
    the batch's mean loss (every row holds as many tokens).

    On a rank of a node (FSDP) either part may hold none of this rank's rows: the rank then
    runs that pass on a one-row stand-in weighted 0, since every rank must take part in FSDP's
    gathers and reductions of both passes; a single process always has rows on both sides."""
    batch = x.shape[0]
    if not 0 <= rows <= batch:
        raise ValueError(f"a step of {batch} rows cannot pause after {rows} of them")
    device = x.device
    parts = []
    for part, share in ((slice(None, rows), rows / batch), (slice(rows, None), 1 - rows / batch)):
        if part.start is not None:
            fn()
        xs, ys = x[part], y[part]
        if xs.shape[0] == 0:
            xs, ys = x[:1], y[:1]
        with autocast(device):
            loss = model.loss(xs, ys)
        (loss * (share * weight)).backward()
        parts.append(loss.detach() * share)
    return parts[0] + parts[1]


def adam_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's AdamW moments and step counts as a flat name -> tensor mapping, on the CPU.

    An optimiser on a GPU has its state copied over (so a state file is the same whatever the
    device, and a write behind never reads memory the next round's steps change); on the CPU
    the tensors are the optimiser's own, as before (the next training waits for their write).
    Under FSDP each moment is a DTensor: its local chunk is what this rank saves.
    """
    out: dict[str, torch.Tensor] = {}
    for i, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            local = getattr(t, "to_local", None)
            if local is not None:
                t = local()
            out[f"{i}.{key}"] = t.detach().cpu()
    return out


def restore_adam(opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load moments saved by ``adam_tensors`` into ``opt`` (same parameter layout); torch puts
    each on its parameter's device (CPU files into a GPU optimiser, and back). Under FSDP each
    saved chunk becomes a DTensor laid out like its parameter."""
    from torch.distributed.tensor import DTensor

    state_dict = opt.state_dict()
    params = [p for group in opt.param_groups for p in group["params"]]
    restored: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        index, name = key.split(".", 1)
        p = params[int(index)]
        if isinstance(p, DTensor) and name != "step":
            t = DTensor.from_local(
                t.to(p.to_local().device), p.device_mesh, p.placements,
                run_check=False, shape=p.shape, stride=p.stride(),
            )  # fmt: skip
        restored.setdefault(int(index), {})[name] = t
    state_dict["state"] = restored
    opt.load_state_dict(state_dict)
