"""The LLaMA-style model (``node.compute.llama``): shapes the codec can tile, deterministic
initialisation, causal attention, training that learns, refused shapes, and a node's round."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from node.compute.model import (
    ModelConfig,
    build_model,
    count_parameters,
    get_preset,
    model_class,
    param_count,
)
from node.compute.optim import InnerOptimConfig, inner_step, make_adamw
from node.compute.worker import Worker
from protocol.codec import decode, encode
from protocol.fingerprint import fingerprint
from protocol.runconfig import RunConfig

LLAMAS = ["llama_tiny", "llama_small", "llama_512m", "llama_1b"]


@pytest.mark.parametrize("preset", LLAMAS)
def test_parameter_count_and_tileable_shapes(preset: str) -> None:
    cfg = get_preset(preset)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    assert count_parameters(model) == param_count(cfg)
    for name, p in model.named_parameters():
        assert p.dim() in (1, 2), name
        assert all(side % 64 == 0 for side in p.shape), (name, tuple(p.shape))


def test_the_large_presets_are_the_sizes_they_claim() -> None:
    assert 0.49e9 < param_count(get_preset("llama_512m")) < 0.55e9
    assert 0.9e9 < param_count(get_preset("llama_1b")) < 1.1e9


def test_the_same_seed_gives_the_same_weights_on_every_build() -> None:
    cfg = get_preset("llama_small")
    a, b, c = (build_model(cfg, seed=s) for s in (3, 3, 4))
    fp = [fingerprint({n: p.data for n, p in m.named_parameters()}) for m in (a, b, c)]
    assert fp[0] == fp[1] != fp[2]
    assert "lm_head.weight" not in dict(a.named_parameters())  # tied by default
    cos = a.get_buffer("rope_cos")
    assert torch.equal(cos, b.get_buffer("rope_cos")) and cos.abs().sum() > 0


def test_attention_is_causal_and_rotary_positions_matter() -> None:
    model = build_model(get_preset("llama_tiny"), seed=0).eval()
    x = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    with torch.no_grad():
        lx, ly = model(x), model(y)
        # Without positions a causal model still sees the prefix; swap two tokens instead.
        z = x.clone()
        z[0, 0], z[0, 1] = x[0, 1], x[0, 0]
        lz = model(z)
    assert torch.equal(lx[0, :10], ly[0, :10])
    assert not torch.allclose(lx[0, 10:], ly[0, 10:])
    assert not torch.allclose(lx[0, 2:], lz[0, 2:])  # order of the prefix changes what follows


def test_a_few_steps_learn_a_repeated_batch() -> None:
    cfg = get_preset("llama_tiny")
    model = build_model(cfg, seed=0)
    optim_cfg = InnerOptimConfig(lr=3e-3, warmup_steps=1, total_steps=30)
    opt = make_adamw(model, optim_cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 32), generator=g)
    y = torch.roll(x, -1, dims=1)
    losses = [inner_step(model, opt, x, y, step=s, cfg=optim_cfg) for s in range(30)]
    assert losses[-1] < 0.5 * losses[0]


def test_the_payload_round_trips_every_tensor() -> None:
    model = build_model(get_preset("llama_small"), seed=0)
    tensors = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    data, recon = encode(tensors, topk=64, tile=64)
    back = decode(data, {n: tuple(t.shape) for n, t in tensors.items()})
    assert set(back) == set(tensors)
    assert all(torch.equal(back[n], recon[n]) for n in tensors)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"ffn_dim": 100}, "ffn_dim=100 must be a multiple of 64"),
        ({"n_heads": 4, "n_kv_heads": 3}, "must be a multiple of n_kv_heads=3"),
        ({"d_model": 96}, "d_model=96 must be a multiple of 64"),
    ],
)
def test_shapes_the_tiles_cannot_cover_are_refused(changes: dict, field: str) -> None:
    values = {"arch": "llama", "d_model": 128, "n_layers": 1, "n_heads": 2, "ctx_len": 32}
    with pytest.raises(ValidationError, match=field):
        ModelConfig(**{**values, **changes})


def test_llama_fields_need_the_llama_arch() -> None:
    with pytest.raises(ValidationError, match="need arch='llama'"):
        ModelConfig(d_model=64, n_layers=1, n_heads=2, ctx_len=32, n_kv_heads=1)


def test_a_node_trains_and_applies_a_llama_round() -> None:
    run = RunConfig(model="llama_tiny", rounds=2, inner_steps=2, batch_size=2)
    w = Worker(run, run_id=run.run_id, node_id="n0", slot=0, eval_batches=1, eval_batch_size=2)
    before = w.fingerprint()
    result = w.train_and_compress()
    assert result.base == before and len(result.payload) > 0
    w.apply({"n0": w.read(result.payload)})
    assert w.fingerprint() != before and w.round == 1
    assert w.evaluate() > 0
