"""``sparseloco data prepare``: text into fixed-size shards of token ids, with a manifest.

Inputs are files, directories (every regular file below, in path order) or globs; a ``.jsonl``
file contributes one document per line (the ``--column`` field, "text" by default), any other
file is one document. Token ids come from one of:

- ``bytes``: the UTF-8 bytes themselves (ids 0-255), what the byte-level models train on;
- ``--tokenizer tokenizer.json``: a Hugging Face ``tokenizers`` file, used as it is;
- ``--train-bpe N``: a byte-level BPE of N entries trained here on the inputs (offline, with the
  ``tokenizers`` library) and written next to the shards.

Each document ends with the end-of-text id (bytes: ``\\n``; BPE: ``<|endoftext|>``), then the
stream is cut into shards of ``--shard-tokens`` ids (the last one shorter), each a raw
little-endian array (uint16 while the vocabulary fits, else uint32). Every ``EVAL_EVERY``-th
shard is held out for evaluation: no node trains on it. ``manifest.json`` lists the tokenizer
(its kind, vocabulary size and the sha256 of its file), the shards (tokens, sha256, split) and
the sources; the sha256 of the manifest's canonical JSON is the dataset id a run names.

``--upload`` copies the folder to ``{prefix}/datasets/{dataset id}/`` in the object store
(boto3, the operator's credentials from the usual AWS variables), manifest last, so a dataset
whose manifest is there is complete.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from protocol.dataset import (
    MANIFEST_FILE,
    TOKENIZER_FILE,
    DatasetManifest,
    ShardInfo,
    TokenizerInfo,
    dataset_key,
)
from protocol.errors import ConfigError
from protocol.runconfig import canonical_json

#: Every this-many-th shard (the 1st, the 21st, ...) is held out for evaluation.
EVAL_EVERY = 20
EOT = "<|endoftext|>"


def input_files(inputs: Sequence[str]) -> list[Path]:
    """Every file the inputs name, in order; ``ConfigError`` for one that names nothing."""
    files: list[Path] = []
    for spec in inputs:
        path = Path(spec)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: str(p))
            if not found:
                raise ConfigError(f"input directory {path} holds no files")
            files += found
        else:
            matches = sorted(Path(m) for m in glob.glob(spec, recursive=True))
            matched = [m for m in matches if m.is_file()]
            if not matched:
                raise ConfigError(f"input {spec!r}: no such file, directory or matching glob")
            files += matched
    return files


def documents(files: Sequence[Path], column: str) -> Iterator[str]:
    """The documents of ``files``: a JSONL line's ``column``, or a whole file."""
    for path in files:
        if path.suffix == ".parquet":
            yield from _parquet(path, column)
        elif path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        value = json.loads(line)[column]
                    except (json.JSONDecodeError, KeyError, TypeError) as exc:
                        raise ConfigError(
                            f"{path}:{n}: expected a JSON object with a {column!r} string"
                            f" ({type(exc).__name__}); choose the field with --column"
                        ) from None
                    if not isinstance(value, str):
                        raise ConfigError(f"{path}:{n}: {column!r} is not a string")
                    yield value
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def _parquet(path: Path, column: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    table = pq.read_table(path, columns=[column])
    yield from (str(v) for v in table.column(column).to_pylist() if v is not None)


class Encoder:
    """Text to ids with the chosen tokenizer."""

    def __init__(self, kind: Literal["bytes", "bpe"], tokenizer: Any = None) -> None:
        self.kind, self.tokenizer = kind, tokenizer
        if kind == "bytes":
            self.vocab_size, self.eot = 256, ord("\n")
        else:
            self.vocab_size = tokenizer.get_vocab_size()
            eot = tokenizer.token_to_id(EOT)
            self.eot = eot if eot is not None else self.vocab_size - 1

    def encode(self, text: str) -> list[int]:
        if self.kind == "bytes":
            return list(text.encode("utf-8"))
        ids: list[int] = self.tokenizer.encode(text).ids
        return ids


def train_bpe(files: Sequence[Path], column: str, vocab_size: int) -> Any:
    """A byte-level BPE of ``vocab_size`` entries trained on the documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents(files, column), trainer=trainer)
    return tok


def prepare(
    inputs: Sequence[str],
    out: Path,
    *,
    column: str = "text",
    tokenizer: str | None = None,
    train_vocab: int | None = None,
    shard_tokens: int = 1 << 20,
) -> DatasetManifest:
    """Tokenise ``inputs`` into shards under ``out`` and write the manifest (see module doc)."""
    if tokenizer and train_vocab:
        raise ConfigError("give --tokenizer or --train-bpe, not both")
    if shard_tokens < 1:
        raise ConfigError("--shard-tokens must be at least 1")
    files = input_files(inputs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "shards").mkdir(exist_ok=True)
    tok_sha = None
    if tokenizer or train_vocab:
        from tokenizers import Tokenizer

        if tokenizer:
            tok = Tokenizer.from_file(tokenizer)
        else:
            if train_vocab is None or train_vocab < 256 + 1:
                raise ConfigError("--train-bpe needs a vocabulary of at least 257 entries")
            tok = train_bpe(files, column, train_vocab)
        tok.save(str(out / "tokenizer.json"))
        tok_sha = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
        encoder = Encoder("bpe", tok)
    else:
        encoder = Encoder("bytes")
    dtype = np.uint16 if encoder.vocab_size <= 1 << 16 else np.uint32
    shards: list[ShardInfo] = []
    buffer: list[int] = []

    def flush(ids: list[int]) -> None:
        data = np.asarray(ids, dtype=dtype).astype(np.dtype(dtype).newbyteorder("<")).tobytes()
        name = f"shards/{len(shards):05d}.bin"
        (out / name).write_bytes(data)
        split: Literal["train", "eval"] = "eval" if len(shards) % EVAL_EVERY == 0 else "train"
        shards.append(
            ShardInfo(
                name=name, tokens=len(ids), sha256=hashlib.sha256(data).hexdigest(), split=split
            )
        )

    for doc in documents(files, column):
        buffer += encoder.encode(doc)
        buffer.append(encoder.eot)
        while len(buffer) >= shard_tokens:
            flush(buffer[:shard_tokens])
            buffer = buffer[shard_tokens:]
    if buffer:
        flush(buffer)
    if not shards:
        raise ConfigError("the inputs hold no text")
    if len(shards) == 1:
        shards[0] = shards[0].model_copy(update={"split": "train"})  # nothing to hold out
    manifest = DatasetManifest(
        tokenizer=TokenizerInfo(
            kind=encoder.kind, vocab_size=encoder.vocab_size, sha256=tok_sha, eot_id=encoder.eot
        ),
        dtype="uint16" if dtype == np.uint16 else "uint32",
        shard_tokens=shard_tokens,
        shards=shards,
        sources=[str(f) for f in files],
    )
    (out / "manifest.json").write_text(manifest.model_dump_json(indent=2) + "\n")
    return manifest


def read_shard(path: Path, manifest: DatasetManifest, info: ShardInfo) -> np.ndarray:
    """A shard's ids, after checking its size and sha256 against the manifest."""
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != info.sha256:
        raise ConfigError(f"{path}: sha256 does not match the manifest")
    ids = np.frombuffer(data, dtype=np.dtype(manifest.dtype).newbyteorder("<"))
    if ids.size != info.tokens:
        raise ConfigError(f"{path}: {ids.size} ids, the manifest says {info.tokens}")
    return ids


def upload(
    out: Path,
    manifest: DatasetManifest,
    *,
    endpoint: str,
    bucket: str,
    prefix: str,
    credentials: tuple[str, str] | None = None,
) -> str:
    """Copy the prepared folder to the store under ``{prefix}/datasets/{hex}/``; the key
    prefix. ``credentials`` (access key, secret key): else boto3's usual sources."""
    import boto3

    keys = {}
    if credentials is not None:
        keys = {"aws_access_key_id": credentials[0], "aws_secret_access_key": credentials[1]}
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys)
    names = [s.name for s in manifest.shards]
    if manifest.tokenizer.kind == "bpe":
        names.append(TOKENIZER_FILE)
    for name in names:
        key = dataset_key(prefix, manifest.dataset_id, name)
        s3.upload_file(os.fspath(out / name), bucket, key)
    # The manifest last (its presence means complete), as its canonical JSON: the bytes whose
    # sha256 is the dataset id, so a node can check the file itself against the id.
    canonical = canonical_json(manifest.model_dump(mode="json"))
    key = dataset_key(prefix, manifest.dataset_id, MANIFEST_FILE)
    s3.put_object(Bucket=bucket, Key=key, Body=canonical)
    return dataset_key(prefix, manifest.dataset_id, "")
