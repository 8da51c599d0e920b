"""A mixture-of-experts feed-forward block for the LLaMA-style model (Mixtral's routing).

``MoE`` replaces a layer's SwiGLU when ``ModelConfig.n_experts`` > 0: a router (a linear map to
one logit per expert), ``n_experts`` SwiGLU experts of width ``ffn_dim`` and, optionally, one
shared expert that every token goes through (DeepSeek's). Each token goes to the
``experts_per_token`` experts of highest router probability (softmax in fp32 over all experts,
the top-k probabilities renormalised to sum to 1), and the block returns the weighted sum of
their outputs, plus the shared expert's.

Routing is **dropless**: no capacity factor, every token reaches its k experts however unevenly
they are loaded; each expert runs once on the rows routed to it (possibly none: it still runs, on
zero rows, so every rank of a sharded node takes part in every expert's gathers and every
expert's gradient exists, zero when idle). The outputs are gathered back with ``index_add_`` in
expert order: deterministic on one device.

Every expert is its own three 2-D matrices (``experts.{e}.gate_proj``, ``up_proj``,
``down_proj``), so the codec tiles each as any matrix (no tile mixes two experts) and an idle
expert's zero pseudo-gradient costs nothing but its error buffer, which keeps what it did not
send. The router is a small dense matrix (experts × d_model).

Load balancing: the Switch/Mixtral auxiliary loss ``E · Σ_e f_e · P_e`` (``f_e``: the share of a
sequence's routing choices that went to expert e, ``P_e``: the mean router probability of e over
the sequence), computed **per sequence** and averaged over the sequences of the batch (the
sequence-wise form DeepSeek-V3 uses), so that a batch split over the ranks of a sharded node adds
up to the same loss as the whole batch in one process. ``Llama.loss`` adds it, times
``router_aux_coef``, to the cross-entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from node.compute.modelconfig import ModelConfig


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: the LLaMA feed-forward block (and one expert)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(probabilities (N, E) in fp32, the top-k weights renormalised (N, k), their experts
    (N, k)) of router ``logits`` (N, E): Mixtral's rule."""
    probs = F.softmax(logits.float(), dim=-1)
    weights, chosen = torch.topk(probs, k, dim=-1)
    return probs, weights / weights.sum(dim=-1, keepdim=True), chosen


def balance_loss(probs: Tensor, chosen: Tensor, batch: int) -> Tensor:
    """The auxiliary load-balancing loss, per sequence and averaged over the ``batch``
    sequences: ``E · Σ_e f_e · P_e`` (module docstring). ``probs`` (B·T, E), ``chosen``
    (B·T, k), rows in sequence order."""
    experts = probs.shape[-1]
    picks = F.one_hot(chosen, experts).float().sum(dim=1)  # (B·T, E): choices per token
    f = picks.view(batch, -1, experts).mean(dim=1) / chosen.shape[-1]  # (B, E)
    p = probs.view(batch, -1, experts).mean(dim=1)  # (B, E)
    return experts * (f * p).sum(dim=-1).mean()


class MoE(nn.Module):
    """Router, experts and an optional shared expert; ``aux`` holds the last forward's
    balance loss (``None`` before any)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.k = cfg.experts_per_token
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg) for _ in range(cfg.n_experts))
        self.shared_expert = SwiGLU(cfg) if cfg.shared_expert else None
        self.aux: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        probs, weights, chosen = route(self.gate(flat), self.k)
        self.aux = balance_loss(probs, chosen, b)
        out = torch.zeros_like(flat)
        weights = weights.to(flat.dtype)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            y = expert(flat[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.view(b, t, d)
