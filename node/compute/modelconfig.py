"""The model's shape (``ModelConfig``) and the named sizes every command offers (``PRESETS``).

Apart from ``node.compute.model`` (which builds the networks with torch) so that what only needs
the table (the console script's help, config checks) reads it without importing torch: the
``--model`` help lists exactly these names.
"""

from __future__ import annotations

import functools
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.runconfig import MODEL_PRESETS


class ModelConfig(BaseModel):
    """Shape of the transformer. Dimensions are multiples of 64 so the codec's tiles divide them.

    ``arch`` "gpt" is this module's byte-level GPT; "llama" is ``node.compute.llama`` (RMSNorm,
    rotary positions, SwiGLU of width ``ffn_dim``, ``n_kv_heads`` key/value heads, a tied or
    separate output head). The fields after ``arch`` are the LLaMA ones; with ``n_experts`` > 0
    every layer's SwiGLU is a mixture of experts (``node.compute.moe``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(default=256, gt=0)
    d_model: int = Field(gt=0)
    n_layers: int = Field(gt=0)
    n_heads: int = Field(gt=0)
    ctx_len: int = Field(gt=0)
    mlp_ratio: int = Field(default=4, gt=0)
    arch: Literal["gpt", "llama"] = "gpt"
    #: Key/value heads (grouped-query attention); None: as many as ``n_heads``.
    n_kv_heads: int | None = Field(default=None, gt=0)
    #: SwiGLU width; None: 8/3 of d_model rounded up to a multiple of 64.
    ffn_dim: int | None = Field(default=None, gt=0)
    tie_embeddings: bool = True
    rope_theta: float = Field(default=10000.0, gt=0)
    norm_eps: float = Field(default=1e-5, gt=0)
    #: Experts per layer (each a SwiGLU of width ``ffn_dim``); 0: a dense SwiGLU.
    n_experts: int = Field(default=0, ge=0, le=256)
    #: Experts each token is routed to (top-k).
    experts_per_token: int = Field(default=2, gt=0)
    #: One more expert that every token goes through (DeepSeek's shared expert).
    shared_expert: bool = False
    #: Weight of the load-balancing loss added to the cross-entropy.
    router_aux_coef: float = Field(default=0.01, ge=0)

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.d_model % 64 != 0:
            raise ValueError(
                f"d_model={self.d_model} must be a multiple of 64 (codec tiles are up to 64 wide);"
                f" use e.g. {max(64, round(self.d_model / 64) * 64)}"
            )
        if self.vocab_size % 64 != 0:
            raise ValueError(
                f"vocab_size={self.vocab_size} must be a multiple of 64; use 256 for bytes"
            )
        if self.d_model % self.n_heads != 0:
            divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0]
            nearest = min(divisors, key=lambda h: abs(h - self.n_heads))
            raise ValueError(
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads};"
                f" use e.g. n_heads={nearest}"
            )
        if self.arch == "llama":
            self._check_llama()
        elif self.n_kv_heads is not None or self.ffn_dim is not None or not self.tie_embeddings:
            raise ValueError("n_kv_heads, ffn_dim and tie_embeddings=false need arch='llama'")
        elif self.n_experts:
            raise ValueError("n_experts needs arch='llama' (the experts are SwiGLU blocks)")
        if self.n_experts and self.experts_per_token > self.n_experts:
            raise ValueError(
                f"experts_per_token={self.experts_per_token} must be at most"
                f" n_experts={self.n_experts}"
            )
        return self

    def _check_llama(self) -> None:
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head width {self.head_dim} must be even for rotary positions")
        for field, value in (("ffn_dim", self.ffn), ("n_kv_heads * head width", self.kv_dim)):
            if value % 64:
                raise ValueError(
                    f"{field}={value} must be a multiple of 64 (codec tiles are up to 64 wide);"
                    f" use e.g. {max(64, -(-value // 64) * 64)}"
                )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def ffn(self) -> int:
        """The MLP's hidden width (one expert's, in a mixture of experts)."""
        if self.arch == "gpt":
            return self.mlp_ratio * self.d_model
        return self.ffn_dim or -(-8 * self.d_model // 3 // 64) * 64


#: A LLaMA as the SparseLoCo paper trains them: a 32,768-entry BPE vocabulary, untied
#: embeddings, 2,048 tokens of context; the sizes are the preset's.
_paper_llama = functools.partial(
    ModelConfig, arch="llama", vocab_size=32768, tie_embeddings=False, ctx_len=2048
)


PRESETS: dict[str, ModelConfig] = {
    # Tests: trains in seconds on one CPU core.
    "tiny": ModelConfig(d_model=64, n_layers=2, n_heads=2, ctx_len=64),
    # CPU benchmark (~0.44M parameters).
    "small": ModelConfig(d_model=128, n_layers=2, n_heads=4, ctx_len=128),
    # ~10.8M: a laptop-sized real run.
    "base": ModelConfig(d_model=384, n_layers=6, n_heads=6, ctx_len=256),
    # ~128M, GPT-2-small class.
    "medium": ModelConfig(d_model=768, n_layers=18, n_heads=12, ctx_len=1024),
    # ~354M, GPT-2-medium class.
    "large": ModelConfig(d_model=1024, n_layers=28, n_heads=16, ctx_len=1024),
    # ~1.01B.
    "1b": ModelConfig(d_model=2048, n_layers=20, n_heads=16, ctx_len=2048),
    # LLaMA-style (node.compute.llama). Tests and CPU runs, bytes as tokens:
    "llama_tiny": ModelConfig(arch="llama", d_model=64, n_layers=2, n_heads=2, ctx_len=64),
    "llama_small": ModelConfig(
        arch="llama", d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=128
    ),
    # ~2.1M with a 4,096-entry vocabulary: CPU runs on BPE shards (``sparseloco data prepare``).
    "llama_bpe4k": ModelConfig(
        arch="llama",
        vocab_size=4096,
        d_model=192,
        n_layers=4,
        n_heads=3,
        ffn_dim=512,
        ctx_len=256,
    ),
    # ~0.95M with the same vocabulary: the H/k sweep on BPE shards (``bench sweep``).
    "llama_bpe4k_1m": ModelConfig(
        arch="llama", vocab_size=4096, d_model=128, n_layers=2, n_heads=2, ffn_dim=384, ctx_len=128
    ),
    # ~12.2M with the same vocabulary: a 30-minute comparison on a quiet 2-core CPU (estimated).
    "llama_bpe4k_12m": ModelConfig(
        arch="llama", vocab_size=4096, d_model=384, n_layers=6, n_heads=6, ffn_dim=1024, ctx_len=256
    ),
    # ~4.2M with the same vocabulary: a dense model of llama_moe's active parameters (the
    # width of its two active experts in one SwiGLU), for the MoE-vs-dense comparison.
    "llama_bpe4k_4m": ModelConfig(
        arch="llama", vocab_size=4096, d_model=256, n_layers=3, n_heads=4, ffn_dim=1024, ctx_len=128
    ),
    # A mixture of experts on the same vocabulary: 8 experts of width 512 in each of 3 layers,
    # 2 per token (Mixtral's routing): ~11.3M parameters, ~4.2M active per token.
    "llama_moe": ModelConfig(
        arch="llama",
        vocab_size=4096,
        d_model=256,
        n_layers=3,
        n_heads=4,
        ffn_dim=512,
        ctx_len=128,
        n_experts=8,
        experts_per_token=2,
    ),
    # ~637M with ~260M active: the shape class of the SparseLoCo paper's MoE (645M-A273M);
    # 8 experts of width 1280 in each of 16 layers, 2 per token, untied 32,768-id embeddings.
    "llama_moe_645m": _paper_llama(
        d_model=1024, n_layers=16, n_heads=16, ffn_dim=1280, n_experts=8, experts_per_token=2
    ),
    # ~520M, the class of the SparseLoCo paper's 512 M LLaMA runs.
    "llama_512m": _paper_llama(d_model=1280, n_layers=22, n_heads=20, ffn_dim=3456),
    # ~0.97B with grouped-query attention (8 key/value heads).
    "llama_1b": _paper_llama(d_model=2048, n_layers=18, n_heads=16, ffn_dim=5504, n_kv_heads=8),
}

if tuple(PRESETS) != MODEL_PRESETS:  # a run config checks names against the protocol's list
    raise RuntimeError("protocol.runconfig.MODEL_PRESETS must list exactly PRESETS, in order")


def get_preset(name: str) -> ModelConfig:
    """Return the preset ``name``; raise ``ValueError`` listing the valid names if unknown."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None
