"""A LLaMA-style model as a Hugging Face ``transformers`` directory.

``write_hf`` writes ``config.json`` (a ``LlamaConfig``) and ``model.safetensors`` (the tensors
under the names ``LlamaForCausalLM`` loads), so ``AutoModelForCausalLM.from_pretrained(out)``
rebuilds the model and generates. A mixture of experts (``node.compute.moe``) is written as a
``MixtralForCausalLM`` (the same routing: softmax, top-k, renormalised), its experts stacked into
Mixtral's two 3-D tensors per layer (``MixtralTensors``). ``node.compute.llama`` already uses
the Hugging Face layout (the rotate-half pairing of rotary positions, RMSNorm in fp32, SwiGLU,
key/value heads repeated in groups), so the tensors are renamed, never transformed (but for the
experts' stacking): the decoder's parameters take the
``model.`` prefix, a separate output head stays ``lm_head.weight``, and a tied head is left out
(``tie_word_embeddings``). Nothing here imports ``transformers``: writing needs only torch (and
the ``tokenizers`` library for a tokenizer).

No process may hold a large model whole, so ``model.safetensors`` is written tensor by tensor:
the header first (names, shapes and offsets are known up front), then each tensor's bytes,
fetched from the mapping only when its turn comes and dropped after. With ``FileTensors`` (the
tensors of a checkpoint on disk, checked by ``protocol.fingerprint.digest_file``, each read
when asked for) the export holds one tensor of the model at a time.

With a tokenizer (``HfTokenizer``: ``load_tokenizer`` of a tokenizer.json or of a folder from
``sparseloco data prepare``, or ``byte_tokenizer`` for the byte-level models) the folder also
holds ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``, so
``AutoTokenizer.from_pretrained(out)`` loads it, and ``config.json``/``generation_config.json``
name the end-of-text id as ``eos_token_id``/``bos_token_id``. The byte tokenizer is exact: id b
is byte b (a byte-level BPE without merges over GPT-2's byte-to-character table), so text
encodes to its UTF-8 bytes and decodes back; ``\n`` (id 10) ends a document, as in the byte
datasets. It names no ``eos_token`` string: ``\n`` is an ordinary token there, and making it a
special one would strip newlines from decoded text and match the character that stands for it
("Ċ") in input. A tokenizer whose vocabulary exceeds the model's is a ``TokenizerError``, raised
before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from node.compute.model import ModelConfig
from node.errors import CheckpointError, DataError
from protocol.fingerprint import CheckedFile

#: Where ``LlamaForCausalLM`` keeps the decoder's parameters.
PREFIX = "model."
HEAD = "lm_head.weight"
#: torch dtype -> (safetensors' name, bytes per element) of what a model may be written in.
ST_DTYPES = {torch.float32: ("F32", 4), torch.bfloat16: ("BF16", 2), torch.float16: ("F16", 2)}
#: A safetensors header is padded with spaces to a multiple of this, as the library does.
HEADER_ALIGN = 8


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` (a ``LlamaConfig``; with experts a ``MixtralConfig``)."""
    if cfg.arch != "llama":
        raise CheckpointError(
            f"only LLaMA-style models export to transformers; this run's model is {cfg.arch!r}"
        )
    if cfg.n_experts:
        if cfg.shared_expert:
            raise CheckpointError(
                "a mixture of experts with a shared expert has no exact transformers class"
                " (Mixtral has none; Qwen2-MoE gates its shared expert): export needs"
                " shared_expert=false"
            )
        experts = {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.router_aux_coef,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "sliding_window": None,
        }
    else:
        experts = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    return experts | {
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


#: Our expert matrices: ``layers.{i}.mlp.experts.{e}.{gate|up|down}_proj.weight``.
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


class MixtralTensors(Mapping[str, torch.Tensor]):
    """``tensors`` under the names and in the layout ``MixtralForCausalLM`` loads: each layer's
    experts stacked into two 3-D tensors, ``mlp.experts.gate_up_proj`` (experts, 2·ffn, d:
    every expert's gate rows, then its up rows) and ``mlp.experts.down_proj`` (experts, d, ffn),
    each built when asked for (one layer's experts in memory at a time); every other tensor
    renamed as for ``LlamaForCausalLM``."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
        self.tensors = tensors
        self.cfg = cfg
        self.names: dict[str, str | tuple[int, str]] = {}
        for name in tensors:
            m = _EXPERT.match(name)
            if m is None:
                self.names[hf_name(name)] = name
            else:
                fused = "gate_up_proj" if m.group(3) in ("gate", "up") else "down_proj"
                self.names[f"{PREFIX}layers.{m.group(1)}.mlp.experts.{fused}"] = (
                    int(m.group(1)),
                    fused,
                )

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        source = self.names[name]
        if isinstance(source, str):
            return _spec(self.tensors, source)
        cfg = self.cfg
        _, dtype = _spec(self.tensors, f"layers.{source[0]}.mlp.experts.0.down_proj.weight")
        if source[1] == "gate_up_proj":
            return (cfg.n_experts, 2 * cfg.ffn, cfg.d_model), dtype
        return (cfg.n_experts, cfg.d_model, cfg.ffn), dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self.names[name]
        if isinstance(source, str):
            return self.tensors[source]
        layer, fused = source
        experts = f"layers.{layer}.mlp.experts"
        if fused == "down_proj":
            return torch.stack(
                [self.tensors[f"{experts}.{e}.down_proj.weight"] for e in range(self.cfg.n_experts)]
            )
        return torch.stack(
            [
                torch.cat([self.tensors[f"{experts}.{e}.{p}_proj.weight"] for p in ("gate", "up")])
                for e in range(self.cfg.n_experts)
            ]
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def hf_name(name: str) -> str:
    """The name ``LlamaForCausalLM`` gives our parameter ``name``."""
    return name if name == HEAD else PREFIX + name


class FileTensors(Mapping[str, torch.Tensor]):
    """The F32 tensors of a checked safetensors file, each read from disk when asked for and
    never kept: the mapping itself holds no tensor."""

    def __init__(self, path: Path, checked: CheckedFile) -> None:
        self.path = path
        self.checked = checked

    def shape(self, name: str) -> tuple[int, ...]:
        return self.checked.entries[name][1]

    def __getitem__(self, name: str) -> torch.Tensor:
        _, shape, begin, end = self.checked.entries[name]
        t = torch.empty(shape, dtype=torch.float32)
        into = t.reshape(-1).view(torch.uint8).numpy().data  # the new tensor's own memory
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.checked.data_start + begin)
            done = 0
            while done < end - begin:
                n = f.readinto(into[done:])
                if not n:
                    raise CheckpointError(f"{self.path} ends inside tensor {name!r}")
                done += n
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.checked.entries)

    def __len__(self) -> int:
        return len(self.checked.entries)


def write_hf(
    tensors: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    out: Path,
    metadata: dict[str, str],
    tokenizer: HfTokenizer | None = None,
) -> list[Path]:
    """Write ``config.json`` and ``model.safetensors`` for ``transformers`` into ``out``, and the
    tokenizer's files when one is given, each atomically; the paths written. ``metadata`` goes
    into the safetensors header. Everything is checked before the first file is written; the
    tensors are taken from ``tensors`` one at a time (``FileTensors``: read from disk)."""
    config = hf_config(cfg)
    files: list[tuple[str, bytes]] = []
    if tokenizer is not None:
        check_tokenizer(tokenizer, cfg)
        files = tokenizer_files(tokenizer, cfg)
        if tokenizer.eot_id is not None:
            config |= {"bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id}
    files.append(("config.json", _json(config)))
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "model.safetensors"
    meta = {"format": "pt", **metadata}
    if cfg.n_experts:
        save_streaming(weights, MixtralTensors(tensors, cfg), meta)
    else:
        save_streaming(weights, tensors, meta, rename=hf_name)
    written = [weights]
    for name, data in files:
        path = out / name
        write_atomically(path, data)
        written.append(path)
    return written


def save_streaming(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    metadata: dict[str, str],
    *,
    rename: Any = None,
) -> None:
    """A safetensors file of ``tensors`` (each under ``rename(name)`` when given) at ``path``,
    atomically, holding one tensor at a time: the header from the shapes, then the bytes."""
    names = {name if rename is None else rename(name): name for name in tensors}
    header: dict[str, Any] = {"__metadata__": metadata}
    specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    offset = 0
    for saved in sorted(names):
        shape, dtype = _spec(tensors, names[saved])
        size = math.prod(shape) * ST_DTYPES[dtype][1]
        header[saved] = {
            "dtype": ST_DTYPES[dtype][0],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        specs.append((names[saved], shape, dtype))
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % HEADER_ALIGN)
    with atomic_writer(path) as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape, dtype in specs:
            t = tensors[name].detach().cpu().contiguous()
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise CheckpointError(f"tensor {name!r} changed while it was written")
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            del t  # before the next one is read


def _spec(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of ``tensors[name]``, without reading it from a ``FileTensors``."""
    if isinstance(tensors, FileTensors):
        return tensors.shape(name), torch.float32
    if isinstance(tensors, MixtralTensors):
        return tensors.spec(name)
    t = tensors[name]
    if t.dtype not in ST_DTYPES:
        raise CheckpointError(f"tensor {name!r} is {t.dtype}; only {sorted(map(str, ST_DTYPES))}")
    return tuple(t.shape), t.dtype


class TokenizerError(DataError):
    """The tokenizer cannot go with this model: unreadable, not the one the dataset was prepared
    with, or a larger vocabulary than the model's."""


@dataclass(frozen=True)
class HfTokenizer:
    """A ``tokenizers`` tokenizer as its ``tokenizer.json`` text, with what the other files say."""

    json: str
    #: Entries, added tokens included: the ids run from 0 to vocab_size - 1.
    vocab_size: int
    #: The id that ends a document (the model's eos/bos), None if unknown.
    eot_id: int | None
    #: ``<|endoftext|>`` when the tokenizer has it: tokenizer_config's eos/bos token.
    eos_token: str | None
    #: Where it came from, for messages.
    source: str


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-character table (what the ``ByteLevel`` pre-tokenizer maps byte b to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def byte_tokenizer() -> HfTokenizer:
    """The tokenizer of the byte-level models: id b is byte b, ``\\n`` (10) ends a document."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return HfTokenizer(tok.to_str(), 256, ord("\n"), None, "bytes (ids 0-255)")


def load_tokenizer(path: Path) -> HfTokenizer:
    """The tokenizer in ``path``: a tokenizer.json, or a folder from ``sparseloco data prepare``
    (its manifest.json names the kind, the end-of-text id and the sha256 of its tokenizer.json,
    checked here); ``TokenizerError`` if it cannot be used."""
    from node.tools.shards import DatasetManifest

    if not path.is_dir():
        return _parse(_read(path), None, str(path))
    manifest_path, tok_path = path / "manifest.json", path / "tokenizer.json"
    if not manifest_path.is_file():
        if tok_path.is_file():
            return _parse(_read(tok_path), None, str(tok_path))
        raise TokenizerError(f"{path} holds neither manifest.json nor tokenizer.json")
    try:
        info = DatasetManifest.model_validate_json(_read(manifest_path)).tokenizer
    except ValueError as exc:
        raise TokenizerError(f"{manifest_path} is not a dataset manifest: {exc}") from exc
    if info.kind == "bytes":
        return byte_tokenizer()
    data = _read(tok_path)
    actual = hashlib.sha256(data).hexdigest()
    if actual != info.sha256:
        raise TokenizerError(
            f"{tok_path} has sha256 {actual}, the dataset's manifest says {info.sha256}: not the"
            " tokenizer these shards were made with"
        )
    return _parse(data, info.eot_id, str(tok_path))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"cannot read tokenizer {path}: {exc.strerror or exc}") from exc


def _parse(data: bytes, eot_id: int | None, source: str) -> HfTokenizer:
    from tokenizers import Tokenizer

    from node.tools.shards import EOT

    try:
        text = data.decode("utf-8")
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # not UTF-8, or tokenizers refused it (it raises bare Exception)
        raise TokenizerError(f"{source} is not a tokenizers tokenizer.json: {exc}") from exc
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos = EOT if tok.token_to_id(EOT) is not None else None
    if eot_id is None:  # as ``sparseloco data prepare`` chose it
        eot_id = tok.token_to_id(EOT) if eos else vocab_size - 1
    return HfTokenizer(text, vocab_size, eot_id, eos, source)


def check_tokenizer(tokenizer: HfTokenizer, cfg: ModelConfig) -> None:
    """``TokenizerError`` unless every id of ``tokenizer`` is a row of the model's embedding."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise TokenizerError(
            f"the tokenizer {tokenizer.source} has {tokenizer.vocab_size:,} entries, more than"
            f" the model's vocabulary of {cfg.vocab_size:,} (ids from {cfg.vocab_size:,} up have"
            " no embedding): give the tokenizer this run's data was prepared with"
        )


def tokenizer_files(tokenizer: HfTokenizer, cfg: ModelConfig) -> list[tuple[str, bytes]]:
    """``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and
    ``generation_config.json`` as ``transformers`` reads them."""
    special = {"bos_token": tokenizer.eos_token, "eos_token": tokenizer.eos_token}
    special = {k: v for k, v in special.items() if v is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.ctx_len,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    files = [
        ("tokenizer.json", tokenizer.json.encode()),
        ("tokenizer_config.json", _json(config)),
        ("special_tokens_map.json", _json(special)),
    ]
    if tokenizer.eot_id is not None:
        ids = {k: tokenizer.eot_id for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        files.append(("generation_config.json", _json(ids)))
    return files


def _json(document: Mapping[str, Any]) -> bytes:
    return (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode()


@contextlib.contextmanager
def atomic_writer(path: Path) -> Iterator[BinaryIO]:
    """A file to write ``path`` through: a temporary file in the same folder, synced and renamed
    over ``path`` when the block ends, removed if it raises."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` to ``path`` through a synced temporary file in the same folder and a rename."""
    with atomic_writer(path) as f:
        f.write(data)


def move_atomically(source: Path, path: Path) -> None:
    """``source`` to ``path`` by a rename, or where they are on two file systems, by a copy
    written as ``atomic_writer`` writes (``source`` is removed either way)."""
    try:
        os.replace(source, path)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        with open(source, "rb") as src, atomic_writer(path) as f:
            while chunk := src.read(1 << 20):
                f.write(chunk)
        source.unlink()
