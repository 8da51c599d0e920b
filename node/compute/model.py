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
``llama_*`` of ``node.compute.llama``); ``param_count`` computes a config's size by arithmetic, so
nobody has to allocate a billion parameters to learn it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

# GPT-2's initialisation scale; residual projections are further scaled by 1/sqrt(2 * n_layers)
# so the residual stream's variance does not grow with depth.
INIT_STD = 0.02


class ModelConfig(BaseModel):
    """Shape of the transformer. Dimensions are multiples of 64 so the codec's tiles divide them.

    ``arch`` "gpt" is this module's byte-level GPT; "llama" is ``node.compute.llama`` (RMSNorm,
    rotary positions, SwiGLU of width ``ffn_dim``, ``n_kv_heads`` key/value heads, a tied or
    separate output head). The fields after ``arch`` are the LLaMA ones.
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
        """The MLP's hidden width."""
        if self.arch == "gpt":
            return self.mlp_ratio * self.d_model
        return self.ffn_dim or -(-8 * self.d_model // 3 // 64) * 64


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
    # ~520M, the class of the SparseLoCo paper's 512 M LLaMA runs (a 32,768-entry BPE vocabulary).
    "llama_512m": ModelConfig(
        arch="llama",
        vocab_size=32768,
        d_model=1280,
        n_layers=22,
        n_heads=20,
        ffn_dim=3456,
        tie_embeddings=False,
        ctx_len=2048,
    ),
    # ~0.97B with grouped-query attention (8 key/value heads).
    "llama_1b": ModelConfig(
        arch="llama",
        vocab_size=32768,
        d_model=2048,
        n_layers=18,
        n_heads=16,
        n_kv_heads=8,
        ffn_dim=5504,
        tie_embeddings=False,
        ctx_len=2048,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """Return the preset ``name``; raise ``ValueError`` listing the valid names if unknown."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters ``build_model(cfg)`` would have, computed without allocating them."""
    d, hidden = cfg.d_model, cfg.ffn
    if cfg.arch == "llama":
        per_layer = 2 * d + 2 * d * d + 2 * d * cfg.kv_dim + 3 * d * hidden
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


class LanguageModel(nn.Module):
    """What both architectures share: ``cfg``, token ids (B, T) in, logits (B, T, V) out, the
    loss, and which matrices feed the residual stream (initialised smaller with depth)."""

    residual: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def check_input(self, idx: Tensor) -> None:
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, time), got {tuple(idx.shape)}")
        if idx.shape[1] > self.cfg.ctx_len:
            raise ValueError(
                f"sequence length {idx.shape[1]} exceeds the model's ctx_len={self.cfg.ctx_len}"
            )

    def reset_buffers(self) -> None:
        """Fill computed buffers after ``to_empty`` (none here)."""

    def units(self) -> list[nn.Module]:
        """The transformer blocks, in order: what FSDP shards one by one (``node.compute.fsdp``)."""
        raise NotImplementedError

    def edges(self) -> list[nn.Module]:
        """Modules outside the blocks that FSDP may shard as units of their own (the embedding
        and a separate output head: with a large vocabulary, more than a block each)."""
        return []

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy in nats over all (B, T) positions."""
        logits = self(idx)
        # Cross-entropy in fp32 even under bf16 autocast: log-softmax in bf16 loses enough
        # precision to show in the loss curve.
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


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
        from node.compute.llama import Llama

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
