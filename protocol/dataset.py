"""A prepared dataset as every party reads it: the manifest, its id, and where it lives.

``sparseloco data prepare`` writes the shards and ``manifest.json``; the sha256 of the
manifest's canonical JSON is the **dataset id** (``sha256:<hex>``) a run names in
``RunConfig.dataset``. Everything else follows from the id:

- the coordinator reads ``{prefix}/datasets/{hex}/manifest.json`` at start, checks it hashes to
  the id and hands out presigned GETs for the files it lists, and for nothing else;
- a node downloads the manifest the same way, checks the same hash, and from then on trusts
  each shard only after its sha256 matches the manifest's.

So neither a tampered store nor a hostile coordinator can feed a node data the run did not
name: the id pins the manifest, the manifest pins every shard.

Shard assignment is a pure function of the manifest and the node's data slot
(``train_shards``, ``slot_shards``): the train shards in manifest order, slot ``s`` of ``n``
taking every ``n``-th from ``s``. Eval shards are held out of every slot.

The API bodies a node fetches them with (``DatasetView``, ``DatasetFilesRequest``,
``DatasetFiles``) are at the end.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from protocol.messages import Message
from protocol.runconfig import DATASET_ID_PATTERN, canonical_json

#: What a shard's file name inside a dataset folder looks like (no way out of the folder).
SHARD_NAME_PATTERN = r"^shards/[0-9]{5,9}\.bin$"
#: The tokenizer file next to the shards of a BPE dataset.
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
#: Most bytes of a dataset manifest.
MAX_MANIFEST_BYTES = 256 << 20


class ShardInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=SHARD_NAME_PATTERN)
    tokens: int = Field(ge=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    split: Literal["train", "eval"]


class TokenizerInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["bytes", "bpe"]
    vocab_size: int = Field(ge=1)
    #: sha256 of tokenizer.json; None for bytes.
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    eot_id: int = Field(ge=0)


class DatasetManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    tokenizer: TokenizerInfo
    dtype: Literal["uint16", "uint32"]
    shard_tokens: int = Field(ge=1)
    shards: list[ShardInfo] = Field(min_length=1)
    sources: list[str]

    @property
    def dataset_id(self) -> str:
        return "sha256:" + hashlib.sha256(canonical_json(self.model_dump(mode="json"))).hexdigest()

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def files(self) -> dict[str, int]:
        """Every file of the dataset a node may fetch, with its size in bytes (the manifest
        itself aside)."""
        width = 2 if self.dtype == "uint16" else 4
        return {s.name: s.tokens * width for s in self.shards}

    def train_shards(self, min_tokens: int = 1) -> list[ShardInfo]:
        """The train shards with at least ``min_tokens`` tokens, in manifest order."""
        return [s for s in self.shards if s.split == "train" and s.tokens >= min_tokens]

    def eval_shards(self, min_tokens: int = 1) -> list[ShardInfo]:
        return [s for s in self.shards if s.split == "eval" and s.tokens >= min_tokens]

    def slot_shards(self, slot: int, n_slots: int, min_tokens: int = 1) -> list[ShardInfo]:
        """Data slot ``slot`` of ``n_slots``'s own train shards: every ``n_slots``-th from
        ``slot``. With fewer train shards than slots, slots share one (their windows still
        differ: they are drawn with the slot in the seed)."""
        if n_slots < 1 or not 0 <= slot < n_slots:
            raise ValueError(f"need 0 <= slot < n_slots, got slot={slot}, n_slots={n_slots}")
        train = self.train_shards(min_tokens)
        if not train:
            return []
        if len(train) < n_slots:
            return [train[slot % len(train)]]
        return train[slot::n_slots]


def parse_manifest(data: bytes, expected_id: str | None = None) -> DatasetManifest:
    """The manifest in ``data``; ``ValueError`` if it is not one, or (with ``expected_id``) if
    it is not the one that id names."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"a dataset manifest of {len(data):,} bytes is over the limit")
    manifest = DatasetManifest.model_validate_json(data)
    if expected_id is not None and manifest.dataset_id != expected_id:
        raise ValueError(
            f"the manifest hashes to {manifest.dataset_id}, the run names {expected_id}"
        )
    return manifest


def dataset_hex(dataset_id: str) -> str:
    """The hex digest of ``sha256:<hex>`` (what the store's key uses)."""
    if not re.match(DATASET_ID_PATTERN, dataset_id):
        raise ValueError(f"invalid dataset id {dataset_id!r}: expected sha256:<64 hex digits>")
    return dataset_id.removeprefix("sha256:")


def dataset_key(prefix: str, dataset_id: str, name: str) -> str:
    """Key of file ``name`` (``manifest.json``, ``tokenizer.json`` or a shard) of a dataset:
    ``{prefix}/datasets/{hex}/{name}``."""
    head = prefix.strip("/")
    root = (
        f"{head}/datasets/{dataset_hex(dataset_id)}"
        if head
        else f"datasets/{dataset_hex(dataset_id)}"
    )
    return f"{root}/{name}"


# The API bodies that hand a node the dataset (``GET /v1/dataset``, ``POST /v1/dataset/files``).
#: Most dataset files one request may ask for.
MAX_DATASET_FILES = 64
DatasetFileName = Annotated[
    str, StringConstraints(pattern=r"^(shards/[0-9]{5,9}\.bin|tokenizer\.json)$")
]


class DatasetView(Message):
    """The run's dataset: its id and a presigned GET of its manifest (``protocol.dataset``).
    The node checks the manifest it downloads hashes to ``dataset``, the id its run config
    names, before it trusts a byte of it."""

    dataset: str
    manifest_url: str
    manifest_size: int = Field(
        gt=0, le=MAX_MANIFEST_BYTES, description="bytes of the manifest (its canonical JSON)"
    )
    expires_in_s: float


class DatasetFilesRequest(Message):
    """Files of the run's dataset a node wants to download (its shards, the tokenizer)."""

    names: list[DatasetFileName] = Field(min_length=1, max_length=MAX_DATASET_FILES)


class DatasetFiles(Message):
    """A presigned GET for each file asked for (each file's size and sha256 are the manifest's)."""

    urls: dict[str, str]
    expires_in_s: float
