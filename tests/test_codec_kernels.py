"""The compiled selection kernel on the inputs that take its rarer paths.

The kernel guesses each tile's threshold from a sample and falls back to scanning the whole
tile when fewer than k entries reach the guess; heavy ties go through the tie rule. Both paths
must give exactly the reference's Top-k (largest magnitudes, ties to the lower position).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol import kernels
from protocol.codec import encode, read_payload
from support import reference_codec as ref


def reference_positions(tile: np.ndarray, k: int) -> list[int]:
    return ref.top_k_positions([float(v) for v in tile.reshape(-1)], k)


def check(x: np.ndarray, k: int) -> None:
    positions, flat, values, finite = kernels.select_topk(x, 64, 64, k)
    assert finite
    gr, gc = x.shape[0] // 64, x.shape[1] // 64
    for t in range(gr * gc):
        ti, tj = divmod(t, gc)
        tile = x[ti * 64 : ti * 64 + 64, tj * 64 : tj * 64 + 64]
        assert positions[t].tolist() == reference_positions(tile, k), f"tile {t}"
    assert np.array_equal(x.reshape(-1)[flat], values)


@pytest.mark.parametrize("k", [64, 128, 300])
def test_fallback_when_the_sampled_guess_is_too_high(k: int) -> None:
    # Every large value sits on a sampled position (every 8th), and there are fewer of them
    # than k: the guess lands among them, too few entries reach it, the kernel must fall back.
    rng = np.random.default_rng(k)
    x = rng.normal(size=(64, 128)).astype(np.float32) * 1e-3
    for tile_origin in (0, 64):
        tile = x[:, tile_origin : tile_origin + 64].reshape(-1).copy()
        tile[0 : 8 * max(1, k // 3) : 8] = 100.0 + rng.random(max(1, k // 3)).astype(np.float32)
        x[:, tile_origin : tile_origin + 64] = tile.reshape(64, 64)
    check(x, k)


@pytest.mark.parametrize("k", [1, 7, 64, 128])
def test_heavy_ties_at_the_threshold(k: int) -> None:
    rng = np.random.default_rng(100 + k)
    x = rng.choice(np.array([0.0, 1.0, -1.0, 2.0], dtype=np.float32), size=(128, 64))
    check(x, k)
    check(np.zeros((64, 64), dtype=np.float32), k)


def test_non_finite_anywhere_is_reported() -> None:
    for value in (np.nan, np.inf, -np.inf):
        x = np.ones((64, 128), dtype=np.float32)
        x[37, 100] = value
        *_, finite = kernels.select_topk(x, 64, 64, 64)
        assert not finite


def test_encode_matches_reference_on_a_real_model_sized_tensor() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(192, 256, generator=gen) * torch.rand(192, 1, generator=gen)
    data, recon = encode({"w": x}, topk=64, tile=64)
    sparse = read_payload(data, {"w": (192, 256)}).tensors["w"]
    r = ref.encode_tensor(x, topk=64, tile=64)
    assert sparse.positions.tolist() == r.positions
    assert torch.equal(sparse.dense(), recon["w"])


def test_threshold_carried_from_tile_to_tile_is_only_a_guess() -> None:
    # Neighbouring tiles at wildly different scales: the threshold carried over from the
    # previous tile is far too high (fallback) or far too low (many candidates) in turn.
    rng = np.random.default_rng(7)
    x = rng.standard_t(3, size=(128, 512)).astype(np.float32)
    for tj in range(8):
        x[:, tj * 64 : tj * 64 + 64] *= np.float32(1e3 if tj % 2 else 1e-3)
    x[64:, 128:192] = 0.25  # a constant tile: every entry ties
    for k in (1, 64, 200):
        check(x, k)


def test_selection_in_small_pieces_over_several_matrices_is_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The encoder selects every tensor's tiles at once, cut into pieces handed to threads; the
    # cut (here a piece of one or two tiles) and the company of other matrices change nothing.
    rng = np.random.default_rng(11)
    jobs = [
        (rng.standard_t(3, size=(128, 192)).astype(np.float32), 64, 64, 64),
        (rng.normal(size=(1, 640)).astype(np.float32), 1, 64, 1),
        (rng.normal(size=(96, 96)).astype(np.float32), 48, 32, 30),
    ]
    alone = [kernels.select_topk(*job) for job in jobs]
    for piece in (64 * 64, 2 * 64 * 64):
        monkeypatch.setattr(kernels, "PIECE_ENTRIES", piece)
        together = kernels.select_topk_many(jobs, flat=True)
        for (pos, flat, vals, ok), (pos1, flat1, vals1, ok1) in zip(together, alone, strict=True):
            assert ok and ok1
            assert np.array_equal(pos, pos1) and np.array_equal(flat, flat1)
            assert np.array_equal(vals, vals1)


def test_map_threads_keeps_item_order_and_raises_the_first_failure_in_that_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernels, "pool_threads", lambda: 2)
    items = list(range(40))
    cost = [(i * 7) % 13 for i in items]  # handed out in an order unlike the items'
    assert kernels.map_threads(lambda i: i * i, items, cost=cost) == [i * i for i in items]

    def fails(i: int) -> int:
        if i in (9, 30):
            raise ValueError(f"item {i}")
        return i

    with pytest.raises(ValueError, match="item 9"):  # 30 is handed out, and fails, first
        kernels.map_threads(fails, items, cost=[float(i) for i in items])
