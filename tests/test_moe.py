"""Mixture-of-experts models (``node.compute.moe``): routing, balance loss, SparseLoCo over
experts, nodes of several ranks, and the export to ``transformers``' Mixtral.

- Routing is Mixtral's and dropless: every token's output is the renormalised top-k weighted sum
  of its experts' outputs, computed here by hand; an expert no token chose still gets a (zero)
  gradient.
- The balance loss is per sequence: a batch split in two adds up to the whole batch's loss (what
  lets a node of several ranks train what one process trains).
- ``write_hf`` writes a ``MixtralForCausalLM`` whose logits match ours (max abs difference
  ≤ 1e-4), which generates; a shared expert, which Mixtral lacks, is refused with the reason.
- A clean round of MoE payloads, idle experts and all, screens nobody.
- Nodes of 2 and 4 ranks (spawned processes, gloo) apply a round of MoE payloads bit for bit as
  one process and train what it trains on FSDP (to rounding); the expert tensors are dealt
  whole and balanced (largest rank within 2.5 % of 1/N at up to 8 ranks).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from node.compute.group import Group
from node.compute.model import ModelConfig, build_model, get_preset, model_shapes
from node.compute.moe import MoE, balance_loss, route
from node.compute.outer import AggregateOptions, apply_aggregate
from node.compute.sharding import balance
from node.compute.work import peer_weights
from node.compute.worker import Worker
from node.errors import CheckpointError
from node.research.bench.codec_bench import error_buffer
from node.tools.hf import write_hf
from protocol.codec import encode, read_payload
from protocol.runconfig import RunConfig
from support.ranks import spawn

H = 10
CORPUS = Path(__file__).resolve().parent.parent / "node" / "corpus"
BIN = Path(sys.executable).parent
SMALL_MOE = ModelConfig(
    arch="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=2, ffn_dim=128, ctx_len=64,
    n_experts=4, experts_per_token=2, tie_embeddings=False,
)  # fmt: skip


def test_routing_is_mixtrals_top_k_and_drops_no_token() -> None:
    torch.manual_seed(0)
    moe = MoE(SMALL_MOE)
    x = torch.randn(3, 10, SMALL_MOE.d_model)
    got = moe(x)
    flat = x.reshape(-1, SMALL_MOE.d_model)
    probs = F.softmax(moe.gate(flat).float(), dim=-1)
    top, chosen = probs.topk(2, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    expected = torch.stack(
        [
            sum(top[i, j] * moe.experts[int(chosen[i, j])](flat[i : i + 1])[0] for j in range(2))
            for i in range(flat.shape[0])
        ]
    )
    torch.testing.assert_close(got.reshape(-1, SMALL_MOE.d_model), expected)


def test_an_idle_expert_gets_a_zero_gradient_not_none() -> None:
    torch.manual_seed(1)
    moe = MoE(SMALL_MOE)
    with torch.no_grad():
        moe.gate.weight[3] = -50.0  # with inputs all positive, no token chooses expert 3
    x = torch.rand(2, 8, SMALL_MOE.d_model)
    moe(x).sum().backward()
    idle, used = (moe.experts[e].gate_proj.weight.grad for e in (3, 0))  # type: ignore[union-attr]
    assert isinstance(idle, torch.Tensor) and torch.count_nonzero(idle) == 0
    assert isinstance(used, torch.Tensor) and torch.count_nonzero(used) > 0


def test_the_balance_loss_of_a_split_batch_adds_up_to_the_whole() -> None:
    torch.manual_seed(2)
    logits = torch.randn(6 * 16, 8)
    probs, _, chosen = route(logits, 2)
    whole = balance_loss(probs, chosen, 6)
    first = balance_loss(probs[: 2 * 16], chosen[: 2 * 16], 2)
    rest = balance_loss(probs[2 * 16 :], chosen[2 * 16 :], 4)
    torch.testing.assert_close(whole, (2 * first + 4 * rest) / 6)
    # Uniform routing is the minimum, 1; all tokens to one pair of experts is E / k = 4.
    uniform = balance_loss(torch.full((8, 8), 1 / 8), torch.arange(16).view(8, 2) % 8, 1)
    assert uniform.item() == pytest.approx(1.0)
    skewed = torch.zeros(8, 8)
    skewed[:, :2] = 0.5
    assert balance_loss(skewed, torch.tensor([[0, 1]] * 8), 1).item() == pytest.approx(4.0)


def test_training_adds_the_balance_loss_and_evaluation_does_not() -> None:
    model = build_model(SMALL_MOE, seed=3)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    model.train()
    trained = model.loss(x, x)
    model.eval()
    evaluated = model.loss(x, x)
    aux = torch.stack([m.aux for m in model.modules() if isinstance(m, MoE) and m.aux is not None])
    aux = aux.mean()
    assert trained.item() == pytest.approx(
        evaluated.item() + SMALL_MOE.router_aux_coef * aux.item()
    )


@pytest.mark.parametrize("cfg", [get_preset("llama_moe"), SMALL_MOE], ids=["preset", "untied"])
def test_transformers_loads_the_export_as_mixtral_with_our_logits(
    tmp_path: Path, cfg: ModelConfig
) -> None:
    ours = build_model(cfg, seed=5).eval()
    write_hf({n: p.data for n, p in ours.named_parameters()}, cfg, tmp_path, {"run_id": "moe"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ours(ids), theirs(ids).logits
    assert (got - expected).abs().max().item() <= 1e-4
    generated = theirs.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
    assert generated.shape == (1, 16) and torch.equal(generated[0, :8], ids[0, :8])


def test_a_shared_expert_is_refused_at_export_with_the_reason(tmp_path: Path) -> None:
    cfg = SMALL_MOE.model_copy(update={"shared_expert": True})
    params = {n: p.data for n, p in build_model(cfg, seed=0).named_parameters()}
    with pytest.raises(CheckpointError, match="shared expert"):
        write_hf(params, cfg, tmp_path, {})
    assert not any(tmp_path.iterdir())


def _expert_deltas(cfg: ModelConfig, seed: int, idle: set[int]) -> dict[str, torch.Tensor]:
    """A pseudo-gradient of ``cfg``'s model: one shared direction plus this peer's noise, and
    zero for the experts in ``idle`` (no token reached them this round)."""
    shapes = model_shapes(cfg)
    common, noise = error_buffer(shapes, seed=1), error_buffer(shapes, seed=seed)
    out = {}
    for name in shapes:
        delta = common[name] + 0.5 * noise[name]
        if any(f".experts.{e}." in name for e in idle):
            delta = torch.zeros_like(delta)
        out[name] = delta
    return out


def test_a_clean_moe_round_screens_nobody() -> None:
    """Five honest peers, each of whose tokens reached only some experts (a third of them idle,
    a different third per peer): the idle experts' zero pseudo-gradients and the small router
    make no peer look hostile, and every expert still moves (some peer used it)."""
    cfg = get_preset("llama_moe")
    shapes = model_shapes(cfg)
    payloads = {}
    for i in range(5):
        idle = {e for e in range(cfg.n_experts) if (e + i) % 3 == 0}
        data, _ = encode(
            _expert_deltas(cfg, 10 + i, idle), topk=64, tile=64, node_id=f"p{i}", steps=H,
        )  # fmt: skip
        payloads[f"p{i}"] = read_payload(data, shapes, topk=64, tile=64)
    theta = {n: torch.zeros(s) for n, s in shapes.items()}
    work = peer_weights({n: p.steps for n, p in payloads.items()}, H, "steps")
    screening = apply_aggregate(theta, payloads, AggregateOptions(robust=True), work)
    assert screening.rejected == {}
    assert all(torch.count_nonzero(t) for n, t in theta.items() if "experts" in n)


def _moe_node(group: Group, out: Path, peers_dir: str) -> None:
    """One rank of a node (or one process) of the MoE preset: a round of peer payloads
    applied, then an inner round trained on FSDP from θ_0."""
    run = RunConfig(name="moe-ranks", model="llama_moe", inner_steps=2, batch_size=4)
    tag = f"t{group.world}" if group.distributed else "solo"
    w = Worker(run, run_id="moe-ranks", node_id="n", slot=1, group=group)
    payloads = {p.stem: w.read(str(p)) for p in sorted(Path(peers_dir).glob("*.slc"))}
    w.apply(payloads)
    fp = w.fingerprint()
    save_file(
        {n: t.contiguous() for n, t in w.params.items()}, str(out / f"{tag}-theta-{group.rank}.st")
    )
    t = Worker(run, run_id="moe-ranks", node_id="n", slot=1, group=group)
    t.placement.begin()
    losses = t.inner.train(0, lr_scale=lambda: 1.0, stop=threading.Event())
    delta = t.placement.finish()
    trained = {n: (t.params[n] - d).contiguous() for n, d in delta.items()}
    save_file(trained, str(out / f"{tag}-trained-{group.rank}.st"))
    if group.rank == 0:
        (out / f"{tag}.json").write_text(json.dumps({"fingerprint": fp, "losses": losses}))


def _gathered(out: Path, tag: str, world: int, kind: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for rank in range(world):
        merged.update(load_file(str(out / f"{tag}-{kind}-{rank}.st")))
    return merged


@pytest.fixture(scope="module")
def moe_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("moe")
    cfg = get_preset("llama_moe")
    for i in range(3):
        data, _ = encode(
            _expert_deltas(cfg, 20 + i, {i}), topk=64, tile=64, run_id="moe-ranks", round=0,
            node_id=f"p{i}", base="f" * 32,
        )  # fmt: skip
        (root / f"p{i}.slc").write_bytes(data)
    out = root / "out"
    out.mkdir()
    _moe_node(Group.solo(), out, str(root))
    assert spawn(2, _moe_node, root, str(root)) == [0, 0]
    assert spawn(4, _moe_node, root, str(root)) == [0, 0, 0, 0]
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_apply_moe_payloads_bit_for_bit_and_train_what_one_process_trains(
    moe_nodes: Path, world: int
) -> None:
    one = json.loads((moe_nodes / "solo.json").read_text())
    many = json.loads((moe_nodes / f"t{world}.json").read_text())
    assert many["fingerprint"] == one["fingerprint"]
    reference, sharded = (
        _gathered(moe_nodes, "solo", 1, "theta"),
        _gathered(moe_nodes, f"t{world}", world, "theta"),
    )
    assert set(sharded) == set(reference)
    for name, value in reference.items():
        assert torch.equal(sharded[name], value), name
    assert many["losses"] == pytest.approx(one["losses"], rel=1e-5)
    # FSDP sums the gradients in another order (and the experts' outputs are gathered per rank):
    # agreement to rounding, far below what two steps move each tensor by.
    trained = _gathered(moe_nodes, f"t{world}", world, "trained")
    initial = build_model(get_preset("llama_moe"), seed=RunConfig().seed).state_dict()
    for name, value in _gathered(moe_nodes, "solo", 1, "trained").items():
        moved = (value - initial[name]).abs().max().item()
        assert moved > 1e-4, (name, moved)  # it trained
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("preset", ["llama_moe", "llama_moe_645m"])
def test_expert_tensors_are_dealt_whole_and_balanced(preset: str) -> None:
    shapes = model_shapes(get_preset(preset))
    for world in (2, 4, 8):
        b = balance(shapes, world)
        assert max(b.loads) <= 1.025 * b.total / world, (preset, world, b.loads)
    assert math.prod(shapes["layers.0.mlp.gate.weight"]) == 8 * get_preset(preset).d_model


def test_up_trains_the_moe_preset_on_bpe_shards_and_exports_mixtral(tmp_path: Path) -> None:
    """The commands of docs/commands.md, as typed there: BPE shards prepared, then ``sparseloco
    up --preset llama_moe --data ds ... --export moe-model``. Every round gathers both nodes
    with one fingerprint, the loss falls below an untrained model's, and the exported folder is
    a ``MixtralForCausalLM`` whose logits are our model's on the run's final θ."""
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "corpus").symlink_to(CORPUS)
    doc = (Path(__file__).parent.parent / "docs" / "commands.md").read_text()
    prepare_line = (
        "sparseloco data prepare node/corpus --out ds --train-bpe 4096 --shard-tokens 16384"
    )
    up_line = "sparseloco up --preset llama_moe --data ds --nodes 2 --rounds 3 --export moe-model"
    assert prepare_line in doc and up_line in doc
    for line in (prepare_line, f"{up_line} --dir run --json up.json"):
        done = subprocess.run(
            [str(BIN / "sparseloco"), *line.split()[1:]],
            capture_output=True, text=True, timeout=900, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "up.json").read_text())
    assert result["run"]["model"] == "llama_moe"
    assert result["fingerprints_agree"] is True
    assert [sorted(r["gather"]) for r in result["rounds"]] == [["node-0", "node-1"]] * 3
    assert result["final_eval_loss"] < math.log(4096)
    exported = tmp_path / "moe-model"
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    theirs = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ours = build_model(get_preset("llama_moe"), seed=0).eval()
    ours.load_state_dict(load_file(str(tmp_path / "run" / "final" / "model.safetensors")))
    ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (theirs(ids).logits - ours(ids)).abs().max().item() <= 1e-4
