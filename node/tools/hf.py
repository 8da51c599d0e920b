"""A LLaMA-style model as a Hugging Face ``transformers`` directory.

``write_hf`` writes ``config.json`` (a ``LlamaConfig``) and ``model.safetensors`` (the tensors
under the names ``LlamaForCausalLM`` loads), so ``AutoModelForCausalLM.from_pretrained(out)``
rebuilds the model and generates. ``node.compute.llama`` already uses the Hugging Face layout
(the rotate-half pairing of rotary positions, RMSNorm in fp32, SwiGLU, key/value heads repeated
in groups), so the tensors are renamed, never transformed: the decoder's parameters take the
``model.`` prefix, a separate output head stays ``lm_head.weight``, and a tied head is left out
(``tie_word_embeddings``). Nothing here imports ``transformers``: writing needs only safetensors.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors

from node.compute.model import ModelConfig
from node.errors import CheckpointError

#: Where ``LlamaForCausalLM`` keeps the decoder's parameters.
PREFIX = "model."
HEAD = "lm_head.weight"


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` (a ``LlamaConfig``)."""
    if cfg.arch != "llama":
        raise CheckpointError(
            f"only LLaMA-style models export to transformers; this run's model is {cfg.arch!r}"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.ctx_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def hf_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters under ``LlamaForCausalLM``'s names."""
    return {
        name if name == HEAD else PREFIX + name: t.detach().cpu().contiguous()
        for name, t in tensors.items()
    }


def write_hf(
    tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, out: Path, metadata: dict[str, str]
) -> list[Path]:
    """Write ``config.json`` and ``model.safetensors`` for ``transformers`` into ``out``, each
    atomically; the paths written. ``metadata`` goes into the safetensors header."""
    config = (json.dumps(hf_config(cfg), indent=2) + "\n").encode()
    weights = save_safetensors(hf_tensors(tensors), metadata={"format": "pt", **metadata})
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in (("model.safetensors", weights), ("config.json", config)):
        path = out / name
        write_atomically(path, data)
        written.append(path)
    return written


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` to ``path`` through a synced temporary file in the same folder and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
