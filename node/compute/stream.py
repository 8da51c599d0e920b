"""Training data from a prepared dataset's shards, one shard at a time.

A node never needs the whole dataset: data slot ``s`` of ``n`` owns the train shards
``DatasetManifest.slot_shards(s, n)`` and walks them in order, ``steps_per_shard`` inner steps
on each, round and round. Within the shard of a step, the batch's windows are drawn at random
with the generator seeded by ``(seed, slot, n_slots, step)``. So, as with ``ByteCorpus``, a batch
is a pure function of the global step: a restarted or late-joining node lands on exactly the
batch it would have had, and needs only the shard that step falls in.

Shards live as files under ``root`` (``shards/NNNNN.bin``, the manifest's names). A local
dataset folder has them all. A node streaming from the object store starts with none: the
``fetch`` it is given (``node.daemon.dataset.ShardFetcher``) downloads a missing shard while the
step waits for it, and is told the next shards of the slot each time one is opened, so the
downloads run ahead of training. Every shard is checked against the manifest's sha256 when it
is loaded, whatever put it there.

Evaluation uses the first ``eval_shards`` held-out shards, which no slot trains on, with windows
evenly spaced over them (no randomness): the same evaluation batches on every node.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from node.compute.seeds import stream_seed
from node.errors import DataError
from protocol.dataset import DatasetManifest, ShardInfo

#: Shards a stream keeps decoded in memory (the current one and the next).
RESIDENT = 2
#: Shards of a slot's sequence fetched ahead of the one being trained on.
READ_AHEAD = 2
#: Held-out shards evaluation draws from.
EVAL_SHARDS = 4


class Fetch(Protocol):
    """Brings shards' files under the stream's root, verified.

    ``wait=True``: return once they are all there (raising if they cannot be had);
    ``wait=False``: start fetching them and return at once (a read-ahead; failures are quiet,
    the later waiting fetch reports them)."""

    def __call__(self, shards: Sequence[ShardInfo], *, wait: bool) -> None: ...


def load_shard(path: Path, manifest: DatasetManifest, info: ShardInfo) -> np.ndarray:
    """A shard's ids, after checking its size and sha256 against the manifest (``DataError``)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read shard {path}: {exc.strerror or exc}") from exc
    if hashlib.sha256(data).hexdigest() != info.sha256:
        raise DataError(f"{path}: sha256 does not match the dataset's manifest")
    ids = np.frombuffer(data, dtype=np.dtype(manifest.dtype).newbyteorder("<"))
    if ids.size != info.tokens:
        raise DataError(f"{path}: {ids.size} ids, the manifest says {info.tokens}")
    if ids.size and int(ids.max()) >= manifest.tokenizer.vocab_size:
        raise DataError(
            f"{path} holds id {int(ids.max())}, outside the dataset's vocabulary of"
            f" {manifest.tokenizer.vocab_size:,}: the dataset was not prepared consistently"
        )
    return ids


class ShardStream:
    """Batches of token windows from a prepared dataset (the ``ByteCorpus`` interface)."""

    def __init__(
        self,
        root: Path,
        manifest: DatasetManifest,
        *,
        ctx_len: int,
        fetch: Fetch | None = None,
        eval_shards: int = EVAL_SHARDS,
    ) -> None:
        if ctx_len < 1:
            raise ValueError(f"ctx_len must be positive, got {ctx_len}")
        self.root = root
        self.manifest = manifest
        self.ctx_len = ctx_len
        self.fetch = fetch
        self.eval_set_shards = manifest.eval_shards(ctx_len + 1)[:eval_shards]
        if not self.eval_set_shards:
            raise DataError(
                f"the dataset {manifest.dataset_id[:19]}... has no held-out shard of at least"
                f" {ctx_len + 1} tokens to evaluate on; prepare it again with a smaller"
                " --shard-tokens (every 20th shard is held out)"
            )
        if not manifest.train_shards(ctx_len + 1):
            raise DataError(
                f"the dataset {manifest.dataset_id[:19]}... has no train shard of at least"
                f" {ctx_len + 1} tokens; prepare it again with a larger --shard-tokens"
            )
        self._resident: OrderedDict[str, Tensor] = OrderedDict()

    def tokens_per_batch(self, batch_size: int) -> int:
        return batch_size * self.ctx_len

    def slot_shards(self, worker: int, n_workers: int) -> list[ShardInfo]:
        """The train shards data slot ``worker`` of ``n_workers`` walks, in order."""
        return self.manifest.slot_shards(worker, n_workers, self.ctx_len + 1)

    def steps_per_shard(self, batch_size: int) -> int:
        """Inner steps spent on each shard: about one pass over a full shard's tokens."""
        return max(1, self.manifest.shard_tokens // self.tokens_per_batch(batch_size))

    def shard_at(self, *, worker: int, n_workers: int, step: int, batch_size: int) -> ShardInfo:
        mine = self.slot_shards(worker, n_workers)
        return mine[(step // self.steps_per_shard(batch_size)) % len(mine)]

    def needed(
        self, *, worker: int, n_workers: int, steps: range, batch_size: int
    ) -> list[ShardInfo]:
        """The distinct shards ``steps`` train on, in the order they are first used."""
        mine = self.slot_shards(worker, n_workers)
        per = self.steps_per_shard(batch_size)
        out: dict[str, ShardInfo] = {}
        for step in steps:
            info = mine[(step // per) % len(mine)]
            out.setdefault(info.name, info)
        return list(out.values())

    # -- shards ------------------------------------------------------------------------------------

    def _tokens(self, info: ShardInfo) -> Tensor:
        """The shard's ids as an int32 tensor: from memory, the disk, or the fetcher."""
        if info.name in self._resident:
            self._resident.move_to_end(info.name)
            return self._resident[info.name]
        path = self.root / info.name
        for attempt in (0, 1):
            if not path.is_file():
                if self.fetch is None:
                    raise DataError(
                        f"shard {info.name} of the dataset is missing from {self.root}"
                        " (a prepared folder must hold every shard its manifest lists)"
                    )
                self.fetch([info], wait=True)
            try:
                ids = torch.from_numpy(load_shard(path, self.manifest, info).astype(np.int32))
                break
            except DataError:
                if self.fetch is None or attempt:
                    raise
                path.unlink(missing_ok=True)  # damaged, or gone meanwhile: fetch it again
        self._resident[info.name] = ids
        while len(self._resident) > RESIDENT:
            self._resident.popitem(last=False)
        return ids

    def _read_ahead(self, mine: list[ShardInfo], index: int) -> None:
        if self.fetch is not None and len(mine) > 1:
            ahead = [mine[(index + i) % len(mine)] for i in range(1, READ_AHEAD + 1)]
            missing = [s for s in ahead if not (self.root / s.name).is_file()]
            if missing:
                self.fetch(missing, wait=False)

    @staticmethod
    def _windows(ids: Tensor, starts: Tensor, ctx_len: int) -> tuple[Tensor, Tensor]:
        window = ids[starts.unsqueeze(1) + torch.arange(ctx_len + 1)].long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    # -- batches -----------------------------------------------------------------------------------

    def train_batch(
        self, *, worker: int, n_workers: int, step: int, batch_size: int, seed: int
    ) -> tuple[Tensor, Tensor]:
        """``batch_size`` random windows from the shard ``step`` falls in (see module doc)."""
        if step < 0 or batch_size < 1:
            raise ValueError(f"need step >= 0 and batch_size >= 1, got {step}, {batch_size}")
        mine = self.slot_shards(worker, n_workers)
        index = (step // self.steps_per_shard(batch_size)) % len(mine)
        ids = self._tokens(mine[index])
        self._read_ahead(mine, index)
        gen = torch.Generator().manual_seed(stream_seed(seed, worker, n_workers, step))
        high = ids.numel() - self.ctx_len  # window starts in [0, high)
        starts = torch.randint(0, high, (batch_size,), generator=gen, dtype=torch.int64)
        return self._windows(ids, starts, self.ctx_len)

    def eval_batches(self, n_batches: int, batch_size: int) -> list[tuple[Tensor, Tensor]]:
        """Fixed evaluation batches from the held-out shards; the same on every call and node."""
        if n_batches < 1 or batch_size < 1:
            raise ValueError(
                f"n_batches and batch_size must be positive, got {n_batches}, {batch_size}"
            )
        if self.fetch is not None:
            self.fetch(self.eval_set_shards, wait=True)
        n = n_batches * batch_size
        counts = torch.tensor([s.tokens - self.ctx_len for s in self.eval_set_shards])
        cum = torch.cumsum(counts, 0)
        total = int(cum[-1])
        ranks = (torch.arange(n, dtype=torch.int64) * 2 + 1) * total // (2 * n)
        shard = torch.searchsorted(cum, ranks, right=True)
        offset = ranks - torch.where(shard > 0, cum[(shard - 1).clamp(min=0)], 0)
        xs, ys = [], []
        for i, info in enumerate(self.eval_set_shards):
            pick = shard == i
            if bool(pick.any()):
                x, y = self._windows(self._tokens(info), offset[pick], self.ctx_len)
                xs.append(x)
                ys.append(y)
        x, y = torch.cat(xs), torch.cat(ys)  # in rank order: shards are visited in order
        return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, n, batch_size)]
