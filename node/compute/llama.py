"""A LLaMA-style decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

The architecture people pre-train at scale (the SparseLoCo paper's 512 M runs, the production
run's 72 B), next to the byte-level GPT of ``node.compute.model``; ``ModelConfig.arch`` picks it.
Pre-norm blocks: RMSNorm -> causal self-attention with rotary positions on q and k -> residual,
RMSNorm -> SwiGLU (``down(silu(gate(x)) * up(x))``) -> residual; a final RMSNorm and an output
head tied to the token embedding or a separate matrix (``tie_embeddings``).

Parameter names follow the Hugging Face ``LlamaForCausalLM`` layout under its ``model.`` prefix
(``embed_tokens``, ``layers.{i}.self_attn.q_proj``, ``layers.{i}.mlp.gate_proj``,
``layers.{i}.input_layernorm``, ``norm``, and ``lm_head`` when untied), so an export is a renaming
and a config file. Every parameter is a 1-D norm gain or a 2-D matrix whose sides are multiples
of 64 (``ModelConfig`` refuses anything else), which is what the codec's tiles need; in a mixture
of experts (``node.compute.moe``) the router, experts × d_model, is the one exception (tiles
divide any side), and an export maps it onto Mixtral's layout. The rotary
tables are buffers, not parameters: computed, never trained or sent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from node.compute.modelbase import LanguageModel
from node.compute.modelconfig import ModelConfig
from node.compute.moe import MoE, SwiGLU


class RMSNorm(nn.Module):
    """x / rms(x) · gain, over the last dimension (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * scale).type_as(x) * self.weight


def rotary_tables(head_dim: int, length: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of every position's rotation angles, (length, head_dim / 2) each."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary positions on (B, H, T, head_dim): each pair (first half, second half) of a head's
    dimensions turned by its position's angle (the "rotate half" pairing of the HF layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class Attention(nn.Module):
    """Causal self-attention, n_kv_heads ≤ n_heads key/value heads shared by groups of heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.kv_heads
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, -1).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.n_kv != self.n_heads:
            group = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp: SwiGLU | MoE = MoE(cfg) if cfg.n_experts else SwiGLU(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(LanguageModel):
    """The decoder; ``forward`` maps token ids (B, T) to logits (B, T, V)."""

    #: Matrices whose output feeds the residual stream: initialised smaller with depth.
    residual = ("o_proj.weight", "down_proj.weight")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
        cos, sin = rotary_tables(cfg.head_dim, cfg.ctx_len, cfg.rope_theta)
        self.rope_cos: Tensor
        self.rope_sin: Tensor
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx: Tensor) -> Tensor:
        self.check_input(idx)
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        x = self.norm(x)
        if self.lm_head is not None:
            return self.lm_head(x)  # through the module: FSDP shards it as a unit of its own
        return F.linear(x, self.embed_tokens.weight)

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        """The cross-entropy, plus the experts' load-balancing loss times ``router_aux_coef``
        in a mixture of experts (``node.compute.moe``)."""
        ce = super().loss(idx, targets)
        if not self.cfg.n_experts or not self.training:
            return ce
        aux = [m.aux for m in self.modules() if isinstance(m, MoE) and m.aux is not None]
        return ce + self.cfg.router_aux_coef * torch.stack(aux).mean()

    def units(self) -> list[nn.Module]:
        return list(self.layers)

    def edges(self) -> list[nn.Module]:
        # The embedding alone when the head is a matrix of its own; tied, the embedding's
        # weight is also read outside its module's forward and stays with the root.
        return [] if self.lm_head is None else [self.embed_tokens, self.lm_head]

    def reset_buffers(self) -> None:
        """The rotary tables again (after ``to_empty``, which leaves buffers uninitialised)."""
        cos, sin = rotary_tables(self.cfg.head_dim, self.cfg.ctx_len, self.cfg.rope_theta)
        self.rope_cos = cos
        self.rope_sin = sin
