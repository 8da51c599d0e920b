"""The model every node trains: a small GPT-style, byte-level, decoder-only transformer.

Pre-norm blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> GELU MLP -> residual),
a learned positional embedding and an output head tied to the token embedding. Vocabulary is the
256 byte values, so no tokenizer has to be shipped or agreed on by the nodes.

Two properties matter to the rest of the system, beyond "it trains":

* ``build_model(cfg, seed=...)`` gives bit-identical weights for the same seed on every machine,
  without touching the global RNG, so all nodes can start from the same θ_0 without a download.
* Parameters have stable names and are all 1-D or 2-D with one tensor per name (the tied head is
  ``F.linear`` on the embedding weight, not a second parameter): the codec tiles exactly those
  shapes.

Sizes come from ``PRESETS`` ("tiny" for tests up to "1b" for real GPUs, and the LLaMA-style
``llama_*`` of ``node.compute.llama``), defined with ``ModelConfig`` in the torch-free
``node.compute.modelconfig`` and re-exported here; ``param_count`` computes a config's size by
arithmetic, so nobody has to allocate a billion parameters to learn it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from node.compute.llama import Llama
from node.compute.modelbase import LanguageModel

# The shape and the named sizes live apart, without torch (the console script's help reads them).
from node.compute.modelconfig import PRESETS, ModelConfig, get_preset

__all__ = ["PRESETS", "ModelConfig", "get_preset"]

# GPT-2's initialisation scale; residual projections are further scaled by 1/sqrt(2 * n_layers)
# so the residual stream's variance does not grow with depth.
INIT_STD = 0.02


def param_count(cfg: ModelConfig, *, active: bool = False) -> int:
    """Number of parameters ``build_model(cfg)`` would have, computed without allocating them;
    ``active``: those one token goes through (a mixture of experts counts the router and the
    ``experts_per_token`` experts of each layer, not all of them)."""
    d, hidden = cfg.d_model, cfg.ffn
    if cfg.arch == "llama":
        ffns = 1
        router = 0
        if cfg.n_experts:
            ffns = (cfg.experts_per_token if active else cfg.n_experts) + int(cfg.shared_expert)
            router = cfg.n_experts * d
        per_layer = 2 * d + 2 * d * d + 2 * d * cfg.kv_dim + ffns * 3 * d * hidden + router
        heads = 1 if cfg.tie_embeddings else 2
        return heads * cfg.vocab_size * d + cfg.n_layers * per_layer + d
    per_block = (
        2 * d  # two LayerNorm weights
        + 3 * d * d  # fused q, k, v
        + d * d  # attention output projection
        + 2 * d * hidden  # MLP up and down
    )
    return cfg.vocab_size * d + cfg.ctx_len * d + cfg.n_layers * per_block + d


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q/k/v projection and no biases."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Attend from each position to itself and earlier positions: (B, T, D) -> (B, T, D)."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (B, T, D) -> (B, H, T, D/H), the layout scaled_dot_product_attention expects.
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))


class MLP(nn.Module):
    """Position-wise feed-forward: up-project, GELU, down-project."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to every position independently."""
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model, bias=False)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model, bias=False)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        """Add the attention and MLP updates to the residual stream."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(LanguageModel):
    """Byte-level decoder-only transformer; the output head is tied to ``tok_emb``."""

    residual = ("attn.proj.weight", "mlp.proj.weight")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.ctx_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = nn.LayerNorm(cfg.d_model, bias=False)

    def units(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, idx: Tensor) -> Tensor:
        """Map token ids ``idx`` (int64, (B, T), T <= ctx_len) to logits of shape (B, T, V)."""
        self.check_input(idx)
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm_f(x), self.tok_emb.weight)


def _init_weights(model: LanguageModel, generator: torch.Generator) -> None:
    """Fill every parameter in ``named_parameters`` order from ``generator`` (GPT-2 scheme)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            _init_one(model, name, p, generator)


def _init_one(model: LanguageModel, name: str, p: Tensor, generator: torch.Generator) -> None:
    """One parameter's initial values, drawing from ``generator`` as ``_init_weights`` does."""
    if p.dim() == 1:  # norm gains
        p.fill_(1.0)
    elif name.endswith(model.residual):
        p.normal_(0.0, INIT_STD / math.sqrt(2 * model.cfg.n_layers), generator=generator)
    else:
        p.normal_(0.0, INIT_STD, generator=generator)


def initial_tensors(cfg: ModelConfig, *, seed: int, names: Iterable[str]) -> dict[str, Tensor]:
    """θ_0 of the tensors ``names`` only, bit for bit what ``build_model(cfg, seed=seed)`` holds.

    The initialisation draws every tensor from one generator in parameter order, so a rank that
    owns some tensors (``node.compute.sharding``) draws the others too, one at a time into
    scratch it drops: its memory holds its own tensors and one more, never the whole model.
    """
    wanted = set(names)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for name, meta in model.named_parameters():
            t = torch.empty(meta.shape, dtype=meta.dtype)
            _init_one(model, name, t, generator)
            if name in wanted:
                out[name] = t
    missing = wanted - set(out)
    if missing:
        raise ValueError(f"the model has no tensors {sorted(missing)[:3]}")
    return out


def model_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of ``cfg``'s model, without allocating it."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def model_class(cfg: ModelConfig) -> type[LanguageModel]:
    """The module class of ``cfg.arch``."""
    if cfg.arch == "llama":
        return Llama
    return GPT


def build_model(cfg: ModelConfig, *, seed: int) -> LanguageModel:
    """Build the model of ``cfg`` on the CPU, its weights depending only on ``cfg`` and ``seed``.

    The modules are created on the meta device and then filled from a local generator, so the
    global RNG is left untouched and the default (discarded) initialisation costs nothing.
    Move the result with ``.to(device)``.
    """
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model.to_empty(device="cpu")
    model.reset_buffers()
    _init_weights(model, torch.Generator(device="cpu").manual_seed(seed))
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters in ``model`` (tied weights are one parameter, counted once)."""
    return sum(p.numel() for p in model.parameters())


def autocast(device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """Mixed precision for ``device``: bf16 autocast on CUDA, a no-op (fp32) elsewhere.

    CPU bf16 autocast is slower than fp32 on most CPUs and changes numerics the tests pin, so the
    CPU path stays in fp32.
    """
    if torch.device(device).type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: LanguageModel, batches: Iterable[tuple[Tensor, Tensor]]) -> float:
    """Mean next-token cross-entropy (nats) over every token of every ``(x, y)`` batch.

    Batches are weighted by their token count, so ragged batches average correctly. The model is
    evaluated in eval mode and returned to whatever mode it was in.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, n_tokens = 0.0, 0
    try:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            with autocast(device):
                logits = model(x)
            total += F.cross_entropy(
                logits.float().view(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            ).item()
            n_tokens += y.numel()
    finally:
        model.train(was_training)
    if n_tokens == 0:
        raise ValueError("evaluate() needs at least one non-empty batch")
    return total / n_tokens
