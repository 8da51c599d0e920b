"""Byte-level training data: load a corpus, split it, and serve deterministic batches.

The corpus is raw bytes (the model's vocabulary is the 256 byte values). It is cut into
fixed-size blocks; every ``eval_every``-th block is held out for evaluation, the rest are training
blocks, and training block ``j`` belongs to worker ``j % n_workers``. The split depends only on the
bytes and the block size, never on the number of workers or the algorithm, so every run on the same
corpus evaluates on the same held-out text.

``ByteCorpus.train_batch`` is a pure function of ``(seed, worker, n_workers, step)``: a worker's
"position in the data" is just its step counter, so a restarted node resumes its stream exactly by
resuming its step count, with nothing else to save. Windows never cross a block boundary, so no
training window ever sees held-out bytes and workers' streams never overlap.

Errors::

    SparseLoCoError
    └── DataError (ValueError)   no file matches, a file is unreadable, the corpus is too small
"""

from __future__ import annotations

import glob
import itertools
import os
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from node.compute.seeds import stream_seed
from node.compute.stream import ShardStream
from node.errors import DataError
from protocol.dataset import MANIFEST_FILE, DatasetManifest, parse_manifest

#: The bundled demo corpus, ``node/corpus/``.
CORPUS_DIR = Path(__file__).parent.parent / "corpus"
DEFAULT_BLOCK_SIZE = 4096
DEFAULT_EVAL_EVERY = 20
_EVAL_KEY = (-1, 0)  # cache key of the held-out set's window table


def _read_files(paths: list[Path]) -> bytes:
    """Read ``paths`` in order and join them with a single newline byte."""
    parts = []
    for path in paths:
        try:
            parts.append(path.read_bytes())
        except OSError as exc:
            raise DataError(f"cannot read corpus file {path}: {exc.strerror or exc}") from exc
    return b"\n".join(parts)


def load_corpus(spec: str | os.PathLike[str] | None) -> bytes:
    """Load training text as bytes.

    ``spec`` is a file, a directory (every regular file below it, recursively, in order of relative
    path), or a glob pattern (its matches that are regular files, sorted). ``None`` means the demo
    corpus bundled with the package (``node/corpus/*.txt``, some Shakespeare plays). Several files
    are joined with a single ``b"\\n"``.
    """
    if spec is None:
        files = sorted(CORPUS_DIR.glob("*.txt"))
        if not files:
            raise DataError(f"the bundled demo corpus is missing: no *.txt in {CORPUS_DIR}")
        return _read_files(files)

    path = Path(spec)
    if path.is_file():
        return _read_files([path])
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.is_file()),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise DataError(f"corpus directory {path} contains no files")
        return _read_files(files)
    if path.exists():
        raise DataError(f"corpus path {path} is neither a regular file nor a directory")
    matches = sorted(Path(m) for m in glob.glob(os.fspath(spec), recursive=True))
    files = [m for m in matches if m.is_file()]
    if not files:
        raise DataError(
            f"no corpus file matches {os.fspath(spec)!r}: give a text file, a directory,"
            " or a glob pattern such as 'data/**/*.txt'"
        )
    return _read_files(files)


class ByteCorpus:
    """A byte corpus split into training and held-out blocks, serving ``(x, y)`` token batches.

    ``x`` and ``y`` are int64 tensors of shape ``(batch_size, ctx_len)``; ``y`` is ``x`` shifted
    left by one byte. A block shorter than ``ctx_len + 1`` bytes (only the last one can be) is
    unused.
    """

    def __init__(
        self,
        data: bytes | Tensor,
        *,
        ctx_len: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        eval_every: int = DEFAULT_EVAL_EVERY,
        held: list[tuple[int, int]] | None = None,
    ) -> None:
        """``data``: bytes, or a 1-D tensor of token ids; ``held``: for token ids, the
        ``(start, end)`` ranges held out for evaluation (a dataset's eval shards), in place of
        every ``eval_every``-th block."""
        if ctx_len < 1:
            raise ValueError(f"ctx_len must be positive, got {ctx_len}")
        if block_size < ctx_len + 1:
            raise ValueError(
                f"block_size={block_size} must be at least ctx_len + 1 = {ctx_len + 1}:"
                " a training window never crosses a block boundary; raise block_size"
            )
        if eval_every < 2:
            raise ValueError(
                f"eval_every must be at least 2 (1 would hold out all), got {eval_every}"
            )
        self.ctx_len = ctx_len
        self.block_size = block_size
        self.eval_every = eval_every
        if isinstance(data, Tensor):
            self._data: Tensor | None = data if data.numel() else None
        else:
            self._data = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
        size = len(data)

        # Only blocks long enough for one window count; the last, partial block may not be.
        starts = [s for s in range(0, size, block_size) if size - s >= ctx_len + 1]
        blocks = [(s, min(s + block_size, size)) for s in starts]
        if held is not None:
            # Blocks never straddle a held-out range's edge: cut at every edge.
            edges = sorted({0, size, *(x for r in held for x in r)})
            blocks = [
                (s, min(s + block_size, hi))
                for lo, hi in itertools.pairwise(edges)
                for s in range(lo, hi, block_size)
                if hi - s >= ctx_len + 1
            ]
            held_out = [any(a <= s < b for a, b in held) for s, _ in blocks]
        else:
            held_out = [i % eval_every == eval_every - 1 for i in range(len(blocks))]
        if len(blocks) >= 2 and not any(held_out):
            held_out[-1] = True  # a corpus under eval_every blocks still gets an eval block
        self.eval_ranges: list[tuple[int, int]] = [
            b for b, h in zip(blocks, held_out, strict=True) if h
        ]
        self.train_ranges: list[tuple[int, int]] = [
            b for b, h in zip(blocks, held_out, strict=True) if not h
        ]
        if not self.eval_ranges or not self.train_ranges:
            raise DataError(
                f"corpus of {len(data)} bytes is too small for ctx_len={ctx_len} with"
                f" block_size={block_size}: it needs at least two blocks of {ctx_len + 1} bytes"
                f" or more ({block_size + ctx_len + 1} bytes); use a larger corpus or a shorter"
                " context"
            )
        # Window-start tables per range list, keyed by (worker, n_workers); (-1, 0) is the eval set.
        self._tables: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    @property
    def n_bytes(self) -> int:
        """Total size of the corpus in bytes."""
        return 0 if self._data is None else self._data.numel()

    def tokens_per_batch(self, batch_size: int) -> int:
        """Number of predicted tokens in one batch of ``batch_size`` windows."""
        return batch_size * self.ctx_len

    def worker_ranges(self, worker: int, n_workers: int) -> list[tuple[int, int]]:
        """The ``(start, end)`` byte ranges of the training blocks that belong to ``worker``."""
        if n_workers < 1 or not 0 <= worker < n_workers:
            raise ValueError(
                f"need 0 <= worker < n_workers, got worker={worker}, n_workers={n_workers}"
            )
        return self.train_ranges[worker::n_workers]

    def _windows(self, starts: Tensor) -> tuple[Tensor, Tensor]:
        """Cut windows of ``ctx_len + 1`` bytes at ``starts`` into ``(x, y)`` int64 batches."""
        if self._data is None:  # unreachable: an empty corpus has no blocks
            raise DataError("the corpus is empty")
        offsets = starts.unsqueeze(1) + torch.arange(self.ctx_len + 1)
        window = self._data[offsets].long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def _starts_table(self, key: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """Block start offsets and cumulative counts of window starts for the eval set or a worker.

        Cached: building it walks every block, which is slow for a large corpus at every step.
        """
        if key not in self._tables:
            ranges = self.eval_ranges if key[0] < 0 else self.worker_ranges(*key)
            begin = torch.tensor([s for s, _ in ranges], dtype=torch.int64)
            n_starts = torch.tensor([e - s - self.ctx_len for s, e in ranges], dtype=torch.int64)
            self._tables[key] = (begin, torch.cumsum(n_starts, 0))
        return self._tables[key]

    def _starts_at(self, key: tuple[int, int], ranks: Tensor) -> Tensor:
        """Map window ranks in ``[0, total)`` to byte offsets, treating all windows as one list."""
        begin, cum = self._starts_table(key)
        block = torch.searchsorted(cum, ranks, right=True)
        before = torch.where(block > 0, cum[(block - 1).clamp(min=0)], torch.zeros_like(ranks))
        return begin[block] + (ranks - before)

    def eval_batches(self, n_batches: int, batch_size: int) -> list[tuple[Tensor, Tensor]]:
        """Fixed evaluation batches, drawn only from held-out blocks; the same on every call.

        Windows are evenly spaced over all held-out window positions (no RNG involved), so the
        set depends only on the corpus, ``ctx_len``, ``n_batches`` and ``batch_size``.
        """
        if n_batches < 1 or batch_size < 1:
            raise ValueError(
                f"n_batches and batch_size must be positive, got {n_batches}, {batch_size}"
            )
        n = n_batches * batch_size
        total = int(self._starts_table(_EVAL_KEY)[1][-1])
        # Centre of each of n equal slices of the window positions; exact integer arithmetic.
        ranks = (torch.arange(n, dtype=torch.int64) * 2 + 1) * total // (2 * n)
        x, y = self._windows(self._starts_at(_EVAL_KEY, ranks))
        return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, n, batch_size)]

    def train_batch(
        self, *, worker: int, n_workers: int, step: int, batch_size: int, seed: int
    ) -> tuple[Tensor, Tensor]:
        """A batch of random windows from ``worker``'s own training blocks.

        A pure function of ``(seed, worker, n_workers, step)``: the same arguments give the same
        batch on any machine, and a resumed worker continues its stream by its step count alone.
        """
        if step < 0 or batch_size < 1:
            raise ValueError(f"need step >= 0 and batch_size >= 1, got {step}, {batch_size}")
        if not self.worker_ranges(worker, n_workers):
            raise DataError(
                f"worker {worker} of {n_workers} has no training block: the corpus has only"
                f" {len(self.train_ranges)} training blocks of {self.block_size} bytes;"
                " use fewer workers, a smaller block_size or a larger corpus"
            )
        key = (worker, n_workers)
        total = int(self._starts_table(key)[1][-1])
        gen = torch.Generator().manual_seed(stream_seed(seed, worker, n_workers, step))
        ranks = torch.randint(0, total, (batch_size,), generator=gen, dtype=torch.int64)
        return self._windows(self._starts_at(key, ranks))


class Corpus(Protocol):
    """What training and evaluation read: ``ByteCorpus``, or a prepared dataset's shards
    (``node.compute.stream.ShardStream``)."""

    ctx_len: int

    def tokens_per_batch(self, batch_size: int) -> int: ...

    def eval_batches(self, n_batches: int, batch_size: int) -> list[tuple[Tensor, Tensor]]: ...

    def train_batch(
        self, *, worker: int, n_workers: int, step: int, batch_size: int, seed: int
    ) -> tuple[Tensor, Tensor]: ...


def open_corpus(
    spec: str | os.PathLike[str] | Corpus | None, *, ctx_len: int, vocab_size: int
) -> Corpus:
    """The training data ``spec`` names: a folder made by ``sparseloco data prepare`` (it holds a
    ``manifest.json``: its shards, streamed a shard at a time, its eval shards held out), text
    for ``load_corpus``, whose bytes are the tokens, or a corpus already open (returned as is)."""
    if spec is not None and not isinstance(spec, str | os.PathLike):
        return spec
    if spec is not None and (Path(spec) / MANIFEST_FILE).is_file():
        root = Path(spec)
        try:
            manifest = parse_manifest((root / MANIFEST_FILE).read_bytes())
        except ValueError as exc:
            raise DataError(f"{root / MANIFEST_FILE} is not a dataset manifest: {exc}") from exc
        check_vocabulary(manifest, vocab_size, where=str(root))
        return ShardStream(root, manifest, ctx_len=ctx_len)
    return ByteCorpus(load_corpus(spec), ctx_len=ctx_len)


def check_vocabulary(manifest: DatasetManifest, vocab_size: int, *, where: str) -> None:
    """A dataset's ids must all be inside the model's vocabulary (``DataError`` if not)."""
    if manifest.tokenizer.vocab_size > vocab_size:
        raise DataError(
            f"{where}: the dataset's vocabulary has {manifest.tokenizer.vocab_size:,} entries,"
            f" the model's {vocab_size:,}; choose a model preset with a larger vocabulary"
            " (llama_bpe4k has 4,096)"
        )
