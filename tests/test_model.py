"""node.compute.model: presets, deterministic init, causality, loss scale, training, evaluate."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from node.compute.model import (
    PRESETS,
    ModelConfig,
    autocast,
    build_model,
    count_parameters,
    evaluate,
    get_preset,
    param_count,
)

TINY = PRESETS["tiny"]


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("tiny", 50_000, 200_000),
        ("small", 400_000, 600_000),
        ("base", 8e6, 12e6),
        ("medium", 110e6, 140e6),
        ("large", 320e6, 380e6),
        ("1b", 0.95e9, 1.1e9),
        ("llama_moe", 10e6, 12e6),
        ("llama_moe_645m", 0.62e9, 0.66e9),
    ],
)
def test_preset_sizes(name: str, low: float, high: float) -> None:
    cfg = get_preset(name)
    assert low <= param_count(cfg) <= high
    for dim in (cfg.d_model, cfg.vocab_size):
        assert dim % 64 == 0


@pytest.mark.parametrize("name", ["tiny", "small", "llama_moe"])
def test_param_count_matches_built_model(name: str) -> None:
    model = build_model(PRESETS[name], seed=0)
    assert count_parameters(model) == param_count(PRESETS[name])


def test_unknown_preset_lists_names() -> None:
    with pytest.raises(ValueError, match=r"tiny.*small"):
        get_preset("huge")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"d_model": 100, "n_layers": 1, "n_heads": 2, "ctx_len": 8}, "d_model"),
        ({"d_model": 128, "n_layers": 1, "n_heads": 3, "ctx_len": 8}, "n_heads"),
        ({"d_model": 64, "n_layers": 1, "n_heads": 1, "ctx_len": 8, "vocab_size": 100}, "vocab"),
        ({"d_model": 64, "n_layers": 0, "n_heads": 1, "ctx_len": 8}, "n_layers"),
        ({"d_model": 64, "n_layers": 1, "n_heads": 1, "ctx_len": 8, "dropout": 0.1}, "dropout"),
    ],
)
def test_config_validation_names_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        ModelConfig.model_validate(kwargs)


def test_parameters_are_named_unique_and_at_most_2d() -> None:
    model = build_model(TINY, seed=0)
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == len(set(names))
    assert names[:2] == ["tok_emb.weight", "pos_emb.weight"]
    assert names[-1] == "norm_f.weight"
    assert all(p.dim() in (1, 2) for p in model.parameters())


def test_same_seed_same_weights_different_seed_different() -> None:
    a, b, c = (build_model(TINY, seed=s) for s in (7, 7, 8))
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name


def test_build_model_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    build_model(TINY, seed=3)
    assert torch.equal(state, torch.random.get_rng_state())


def test_causal_masking() -> None:
    model = build_model(TINY, seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (2, TINY.ctx_len), generator=gen)
    changed = idx.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % 256
    with torch.no_grad():
        before, after = model(idx), model(changed)
    assert before.shape == (2, TINY.ctx_len, 256)
    torch.testing.assert_close(before[:, :40], after[:, :40], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 40:], after[:, 40:])


def test_too_long_input_is_rejected() -> None:
    model = build_model(TINY, seed=0)
    with pytest.raises(ValueError, match="ctx_len"):
        model(torch.zeros(1, TINY.ctx_len + 1, dtype=torch.long))


def test_untrained_loss_is_near_uniform() -> None:
    model = build_model(TINY, seed=0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (8, TINY.ctx_len), generator=gen)
    y = torch.randint(0, 256, (8, TINY.ctx_len), generator=gen)
    assert abs(model.loss(x, y).item() - math.log(256)) < 0.1


def test_training_on_repeated_text_drives_loss_down() -> None:
    text = b"To be, or not to be, that is the question. " * 40
    tokens = torch.tensor(list(text), dtype=torch.long)
    model = build_model(TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(200):
        starts = torch.randint(0, len(tokens) - TINY.ctx_len - 1, (8,), generator=gen)
        window = torch.stack([tokens[s : s + TINY.ctx_len + 1] for s in starts.tolist()])
        loss = model.loss(window[:, :-1], window[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0
    assert sum(losses[-10:]) / 10 < 0.5


def test_evaluate_matches_hand_computed_mean_and_restores_mode() -> None:
    model = build_model(TINY, seed=0)
    model.train()
    gen = torch.Generator().manual_seed(2)
    # Ragged batches: the mean must be over tokens, not over batches.
    batches = [
        (torch.randint(0, 256, (b, t), generator=gen), torch.randint(0, 256, (b, t), generator=gen))
        for b, t in [(3, 16), (1, 64), (2, 5)]
    ]
    with torch.no_grad():
        nll = [
            F.cross_entropy(model(x).view(-1, 256), y.view(-1), reduction="none")
            for x, y in batches
        ]
    expected = torch.cat(nll).double().mean().item()
    assert evaluate(model, batches) == pytest.approx(expected, rel=1e-6)
    assert model.training
    model.eval()
    evaluate(model, batches[:1])
    assert not model.training


def test_evaluate_rejects_empty() -> None:
    with pytest.raises(ValueError, match="at least one"):
        evaluate(build_model(TINY, seed=0), [])


def test_autocast_is_noop_on_cpu() -> None:
    with autocast(torch.device("cpu")):
        out = torch.ones(2, 2) @ torch.ones(2, 2)
    assert out.dtype == torch.float32


def test_a_mixture_of_experts_counts_its_active_parameters() -> None:
    """The paper's MoE is 645M with 273M active; the shape here is of that class."""
    small, paper = get_preset("llama_moe"), get_preset("llama_moe_645m")
    assert 4.0e6 <= param_count(small, active=True) <= 4.5e6
    assert 0.25e9 <= param_count(paper, active=True) <= 0.28e9
    dense = get_preset("llama_bpe4k")
    assert param_count(dense, active=True) == param_count(dense)
