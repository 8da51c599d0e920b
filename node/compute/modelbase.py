"""What every architecture of the node's model shares (``LanguageModel``).

Its own module so that the architectures (``node.compute.model``'s GPT, ``node.compute.llama``)
build on it and ``node.compute.model``, which picks the class of a config's ``arch``, imports them:
the imports run one way, never back.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from node.compute.modelconfig import ModelConfig


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
