"""node.compute.data: corpus loading, the train/eval split, and deterministic worker streams."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from node.compute.data import ByteCorpus, load_corpus
from node.errors import DataError

BLOCK = 64
CTX = 16


def labelled_corpus(n_blocks: int) -> bytes:
    """Block i filled with byte value i, so a window's bytes say which block it came from."""
    return b"".join(bytes([i]) * BLOCK for i in range(n_blocks))


# ---- loading ----------------------------------------------------------------------------------


def test_load_bundled_corpus() -> None:
    data = load_corpus(None)
    assert 800_000 < len(data) < 1_300_000
    assert b"Hamlet" in data and b"Macbeth" in data


def test_load_file_dir_and_glob(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"bee")
    (tmp_path / "a.txt").write_bytes(b"ay")
    (tmp_path / "sub" / "c.md").write_bytes(b"sea")
    assert load_corpus(tmp_path / "b.txt") == b"bee"
    assert load_corpus(str(tmp_path / "b.txt")) == b"bee"
    # Directory: recursive, sorted by relative path, joined by one newline.
    assert load_corpus(tmp_path) == b"ay\nbee\nsea"
    assert load_corpus(str(tmp_path / "*.txt")) == b"ay\nbee"
    assert load_corpus(str(tmp_path / "**" / "*.md")) == b"sea"
    # A glob matching only a directory has no regular file.
    with pytest.raises(DataError, match="no corpus file matches"):
        load_corpus(str(tmp_path / "su*"))


def test_bad_specs(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no corpus file matches"):
        load_corpus(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="no corpus file matches"):
        load_corpus(str(tmp_path / "*.nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="contains no files"):
        load_corpus(tmp_path / "empty")
    assert issubclass(DataError, ValueError)


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.txt"
    path.write_bytes(b"x")

    def deny(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", deny)
    with pytest.raises(DataError, match="cannot read corpus file"):
        load_corpus(path)


# ---- split --------------------------------------------------------------------------------------


def test_too_small_corpus() -> None:
    with pytest.raises(DataError, match="too small"):
        ByteCorpus(b"x" * 70, ctx_len=CTX, block_size=BLOCK)
    with pytest.raises(DataError, match="too small"):
        ByteCorpus(b"", ctx_len=CTX, block_size=BLOCK)
    with pytest.raises(ValueError, match="block_size"):
        ByteCorpus(b"x" * 1000, ctx_len=BLOCK, block_size=BLOCK)


def test_split_is_fixed_by_block_index() -> None:
    corpus = ByteCorpus(labelled_corpus(100), ctx_len=CTX, block_size=BLOCK, eval_every=10)
    held_out = [s // BLOCK for s, _ in corpus.eval_ranges]
    assert held_out == [9, 19, 29, 39, 49, 59, 69, 79, 89, 99]
    assert len(corpus.train_ranges) == 90
    # A corpus shorter than eval_every blocks still holds its last block out.
    small = ByteCorpus(labelled_corpus(3), ctx_len=CTX, block_size=BLOCK, eval_every=10)
    assert [s // BLOCK for s, _ in small.eval_ranges] == [2]


def test_eval_batches_fixed_and_held_out_only() -> None:
    corpus = ByteCorpus(labelled_corpus(100), ctx_len=CTX, block_size=BLOCK, eval_every=10)
    held_out = {s // BLOCK for s, _ in corpus.eval_ranges}
    batches = corpus.eval_batches(4, 5)
    assert len(batches) == 4
    for x, y in batches:
        assert x.shape == y.shape == (5, CTX)
        assert x.dtype == y.dtype == torch.int64
        assert set(x.unique().tolist()) <= held_out
    # Every held-out block is visited, and the result is the same on every call.
    assert {int(x[i, 0]) for x, _ in batches for i in range(len(x))} == held_out
    again = corpus.eval_batches(4, 5)
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(batches, again, strict=True)
    )


def test_y_is_x_shifted() -> None:
    data = bytes(range(256)) * 20
    corpus = ByteCorpus(data, ctx_len=CTX, block_size=BLOCK)
    x, y = corpus.train_batch(worker=0, n_workers=1, step=0, batch_size=8, seed=0)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal((x[:, 0] + 1) % 256, y[:, 0])


# ---- worker streams -----------------------------------------------------------------------------


def test_train_windows_stay_in_own_training_blocks() -> None:
    corpus = ByteCorpus(labelled_corpus(100), ctx_len=CTX, block_size=BLOCK, eval_every=10)
    held_out = {s // BLOCK for s, _ in corpus.eval_ranges}
    n_workers = 4
    seen: list[set[int]] = []
    for worker in range(n_workers):
        own = {s // BLOCK for s, _ in corpus.worker_ranges(worker, n_workers)}
        blocks: set[int] = set()
        for step in range(20):
            x, y = corpus.train_batch(
                worker=worker, n_workers=n_workers, step=step, batch_size=16, seed=1
            )
            window = torch.cat([x, y[:, -1:]], dim=1)
            # All bytes of a window equal: it never crosses a block boundary.
            assert torch.equal(window, window[:, :1].expand_as(window))
            blocks |= set(window[:, 0].tolist())
        assert blocks <= own
        assert not blocks & held_out
        seen.append(blocks)
    for i in range(n_workers):
        for j in range(i + 1, n_workers):
            assert not seen[i] & seen[j]


def test_train_batch_is_a_pure_function_of_its_arguments() -> None:
    corpus = ByteCorpus(load_corpus(None)[:200_000], ctx_len=32, block_size=1024)
    args = {"worker": 1, "n_workers": 3, "batch_size": 4, "seed": 5}
    x1, y1 = corpus.train_batch(step=7, **args)
    x2, y2 = ByteCorpus(load_corpus(None)[:200_000], ctx_len=32, block_size=1024).train_batch(
        step=7, **args
    )
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x3, _ = corpus.train_batch(step=8, **args)
    assert not torch.equal(x1, x3)
    x4, _ = corpus.train_batch(step=7, **{**args, "seed": 6})
    assert not torch.equal(x1, x4)


def test_train_batch_argument_errors() -> None:
    corpus = ByteCorpus(labelled_corpus(10), ctx_len=CTX, block_size=BLOCK, eval_every=10)
    # 9 training blocks: a 10th worker has none.
    with pytest.raises(DataError, match="no training block"):
        corpus.train_batch(worker=9, n_workers=10, step=0, batch_size=1, seed=0)
    with pytest.raises(ValueError, match="worker"):
        corpus.train_batch(worker=2, n_workers=2, step=0, batch_size=1, seed=0)
    with pytest.raises(ValueError, match="step"):
        corpus.train_batch(worker=0, n_workers=1, step=-1, batch_size=1, seed=0)
    assert corpus.tokens_per_batch(8) == 8 * CTX
