"""A node of several processes: the same θ as one process, whatever the rank count.

The unit tests run real ``Worker``s of 2 and 4 ranks (spawned processes, gloo on loopback) and
one process side by side on the same inputs and check, bit for bit:

- applying a round (robust screening with a hostile peer, median-norm clipping, the value
  bound) leaves every rank's tensors exactly as a single process leaves them, with the same
  fingerprint and the same peers screened out;
- the payload the ranks encode together is byte for byte the single process's payload;
- a checkpoint file the ranks write together is byte for byte the single process's, and loads
  into a node of another rank count;
- the state a node of 2 ranks saved loads into 4 ranks and into one process (resharded), θ and
  e unchanged;

and that FSDP's inner steps train what one process trains (to rounding: FSDP sums gradients in
another order), also with overlap "merge" pausing inside a step (θ after the merge bit for
bit). The integration tests run torchrun nodes of 2 and 4 processes in a real run.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file, save_file

from node.compute.checkpoint import load_checkpoint_file, write_checkpoint_file
from node.compute.group import Group
from node.compute.model import get_preset, model_shapes
from node.compute.sharding import assign, balance, owned
from node.compute.worker import Worker
from node.daemon.merge import Handoff
from node.daemon.ops import RankContext, merge_now
from node.daemon.pending import Shard, restore_state, save_idle
from node.errors import Abandoned
from node.research.bench.codec_bench import error_buffer
from protocol.codec import encode, read_payload
from protocol.runconfig import RunConfig
from support.ranks import spawn

#: batch_size 5 over 2 or 4 processes: rows of unequal count, so the weighting by rows matters.
RUN = RunConfig(name="ranks", model="llama_small", rounds=4, inner_steps=3, batch_size=5)
RUN_ID = "ranks-test"
SHAPES = model_shapes(get_preset(RUN.model))
PEERS = ("a", "b", "c", "d", "e")
#: The hostile peer: the first honest update with every sign flipped.
FLIPPED = "e"
ROUND = 2


def _worker(group: Group | None = None) -> Worker:
    return Worker(RUN, run_id=RUN_ID, node_id="n", slot=3, group=group)


#: The inner steps each peer's payload carries, and its entries per tile: unequal work and a
#: thinner payload, so the applies below aggregate by the run's work rule with mixed k.
PEER_STEPS = {"a": 3, "b": 1, "c": 2, "d": 3, "e": 3}
PEER_TOPK = {"a": 64, "b": 64, "c": 16, "d": 64, "e": 64}


def _peer_payloads(directory: Path) -> dict[str, Path]:
    """Four honest payloads (one direction, each with its own noise) and a sign-flipped one;
    of unequal work (``PEER_STEPS``), one of them thinner (``PEER_TOPK``)."""
    shapes = model_shapes(get_preset(RUN.model))
    common = error_buffer(shapes, seed=1)
    out = {}
    for i, node in enumerate(PEERS):
        if node == FLIPPED:
            buffer = {n: -t for n, t in error_buffer(shapes, seed=1).items()}
        else:
            noise = error_buffer(shapes, seed=10 + i)
            buffer = {n: common[n] + 0.5 * noise[n] for n in shapes}
        data, _ = encode(
            buffer, topk=PEER_TOPK[node], tile=RUN.tile, run_id=RUN_ID, round=ROUND,
            node_id=node, base="f" * 32, steps=PEER_STEPS[node],
        )  # fmt: skip
        path = directory / f"{node}.slc"
        path.write_bytes(data)
        out[node] = path
    return out


class _Handoff:
    """Rank 0's hand-off at the merge (``node.daemon.merge.Handoff``), with its transfers'
    outcome given: None (nothing came) or (the manifest's base, the payload files)."""

    def __init__(self, outcome: tuple[str, dict[str, str]] | None) -> None:
        self.round, self.outcome = ROUND, outcome
        self.diverged = False
        self.applied: Any = None

    def wait(self) -> Any:
        if self.outcome is None:
            raise Abandoned()
        base, blobs = self.outcome
        manifest = SimpleNamespace(base_fingerprint=base, steps=dict)  # no steps listed
        return SimpleNamespace(manifest=manifest, blobs=blobs)


def _merge_word(group: Group, out: Path, peers_dir: str, tag: str) -> list[Any]:
    """``ops.merge_now`` on every rank, rank 0 with the hand-off and the others waiting for its
    word: nothing came, a base that is not θ's, then the gather set. What each one did."""
    w = _worker(group)
    ctx = RankContext(cast(Any, None), group, Shard(out / f"{tag}-merge-state", group, w))
    theta0 = w.fingerprint()
    files = {p.stem: str(p) for p in sorted(Path(peers_dir).glob("*.slc"))}
    done: list[Any] = []
    for outcome in (None, ("0" * 32, files), (theta0, files)):
        handoff = _Handoff(outcome) if group.leader else None
        w.placement.begin()
        try:
            merge_now(ctx, cast(Handoff, handoff))
            applied = handoff and [handoff.applied[0], sorted(handoff.applied[1])]
            done.append(["merged", applied, w.fingerprint()])
        except Abandoned:
            done.append(["abandoned", handoff and handoff.diverged, w.fingerprint() == theta0])
        w.placement.abandon()
    return done


def _own_buffer(worker: Worker) -> dict[str, torch.Tensor]:
    every = error_buffer(worker.shapes, seed=99)
    return {n: every[n].clone() for n in worker.owned}


def _node(group: Group, out: Path, peers_dir: str, state_from: str | None) -> None:
    """Everything the unit tests compare, on one rank of a node of ``group.world``."""
    world, rank = group.world, group.rank
    tag = f"t{world}" if group.distributed else "solo"
    w = _worker(group)
    # 1. Apply a round of peer payloads (read from files, each rank its tensors).
    payloads = {p.stem: w.read(str(p)) for p in sorted(Path(peers_dir).glob("*.slc"))}
    screened = w.apply(payloads)
    fp = w.fingerprint()
    save_file({n: t.contiguous() for n, t in w.params.items()}, str(out / f"{tag}-theta-{rank}.st"))
    # 2. Encode an error buffer together.
    w.error = _own_buffer(w)
    payload, _ = w._compress(ROUND + 1, fp)
    # 3. A checkpoint file written together, and loaded again.
    ckpt = out / f"{tag}.ckpt"
    size, sha, ckpt_fp = write_checkpoint_file(w, ckpt)
    other = _worker(group)
    load_checkpoint_file(other, ckpt, round_=w.round, expected=ckpt_fp)
    assert other.fingerprint() == fp
    # 4. The state saved by this node (and, if given, the one another rank count saved).
    shard = Shard(out / f"{tag}-state", group, w)
    save_idle(shard)
    loaded = {}
    if state_from is not None:
        fresh = _worker(group)
        pending, resumed = restore_state(Shard(Path(state_from), group, fresh))
        assert resumed and pending is None
        loaded = {"theta": fresh.fingerprint(), "round": fresh.round, "steps": fresh.local_steps}
        save_file(
            {f"e.{n}": t.contiguous() for n, t in fresh.error.items()},
            str(out / f"{tag}-loaded-error-{rank}.st"),
        )
    # 5. Inner steps on FSDP: two rounds from θ_0.
    t = _worker(group)
    t.placement.begin()
    losses = t.inner.train(0, lr_scale=lambda: 0.7, stop=threading.Event())
    losses += t.inner.train(1, lr_scale=lambda: 0.7, stop=threading.Event())
    delta = t.placement.finish()
    trained = {n: (t.params[n] - d).contiguous() for n, d in delta.items()}
    save_file(trained, str(out / f"{tag}-trained-{rank}.st"))
    # 6. Overlap "merge" inside a step on FSDP: round 0 from θ_0, the peers' payloads merged
    # after 2 of the 5 rows of its second step (on 4 ranks some ranks hold rows on one side).
    m = _worker(group)
    gathered = {p.stem: m.read(str(p)) for p in sorted(Path(peers_dir).glob("*.slc"))}
    merged: list[list[str]] = []
    m.placement.begin()
    merge_losses = m.inner.train(
        0, lr_scale=lambda: 0.7, stop=threading.Event(),
        pause=(2, 2, lambda: merged.append(sorted(m.merge(gathered)))),
    )  # fmt: skip
    delta = m.placement.finish()
    save_file(
        {n: (m.params[n] - d).contiguous() for n, d in delta.items()},
        str(out / f"{tag}-merged-{rank}.st"),
    )
    merge_fp = m.fingerprint()  # a collective: every rank
    # 7. The ranks' word at the merge (``ops.merge_now``).
    word = _merge_word(group, out, peers_dir, tag)
    # 8. A round's time budget on rank 0 only: its cutoff long past and 16 entries per tile
    # planned. Every rank stops after the first step (the word is agreed with the stop flag),
    # and every rank encodes with rank 0's k.
    b = _worker(group)
    if rank == 0:
        b.cutoff, b.send_topk = float("-inf"), 16
    budgeted = b.train_and_compress()
    budget_facts = {"steps": budgeted.steps, "topk": budgeted.topk}
    if rank == 0:
        (out / f"{tag}-payload.slc").write_bytes(payload)
        (out / f"{tag}-budgeted.slc").write_bytes(budgeted.payload)
        facts = {
            "fingerprint": fp, "screened": sorted(screened), "checkpoint": [size, sha, ckpt_fp],
            "losses": losses, "loaded": loaded, "merged": merged,
            "merge_fingerprint": merge_fp, "merge_losses": merge_losses, "merge_word": word,
            "budgeted": budget_facts,
        }  # fmt: skip
        (out / f"{tag}.json").write_text(json.dumps(facts))


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One plain process (the reference), then torchrun-like nodes of 1, 2 and 4 ranks (the
    4-rank one loads the 2-rank one's state), each through every check of ``_node``. A node of
    one rank under torchrun keeps its outer state on its device and trains on FSDP too."""
    root = tmp_path_factory.mktemp("ranks")
    peers = _peer_payloads(root)
    out = root / "out"
    out.mkdir()
    _node(Group.solo(), out, str(root), None)
    assert spawn(1, _node, root, str(root), None) == [0]
    assert spawn(2, _node, root, str(root), None) == [0, 0]
    assert spawn(4, _node, root, str(root), str(out / "t2-state")) == [0, 0, 0, 0]
    return {"out": out, "peers": peers}


def _theta(out: Path, tag: str, world: int, kind: str = "theta") -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for rank in range(world):
        part = load_file(str(out / f"{tag}-{kind}-{rank}.st"))
        assert not set(part) & set(merged), "two ranks hold the same tensor"
        merged.update(part)
    return merged


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_count_applies_bit_for_bit_what_one_process_applies(nodes, world) -> None:
    out = nodes["out"]
    one = json.loads((out / "solo.json").read_text())
    many = json.loads((out / f"t{world}.json").read_text())
    assert one["screened"] == [FLIPPED]  # the screening did something
    assert many["screened"] == one["screened"]
    assert many["fingerprint"] == one["fingerprint"]
    reference = _theta(out, "solo", 1)
    sharded = _theta(out, f"t{world}", world)
    assert set(sharded) == set(reference)
    for name, value in reference.items():
        assert torch.equal(sharded[name], value), name


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_stops_where_rank_0s_budget_says_and_sends_its_k(nodes, world) -> None:
    out = nodes["out"]
    for tag in ("solo", f"t{world}"):
        facts = json.loads((out / f"{tag}.json").read_text())
        assert facts["budgeted"] == {"steps": 1, "topk": 16}, tag
        payload = read_payload((out / f"{tag}-budgeted.slc").read_bytes(), SHAPES, topk=RUN.topk)
        assert (payload.steps, payload.topk) == (1, 16), tag


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_encode_the_single_process_payload_byte_for_byte(nodes, world) -> None:
    out = nodes["out"]
    assert (out / f"t{world}-payload.slc").read_bytes() == (out / "solo-payload.slc").read_bytes()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_checkpoint_written_by_ranks_is_the_single_process_file(nodes, world) -> None:
    out = nodes["out"]
    one = json.loads((out / "solo.json").read_text())["checkpoint"]
    many = json.loads((out / f"t{world}.json").read_text())["checkpoint"]
    assert many == one
    assert (out / f"t{world}.ckpt").read_bytes() == (out / "solo.ckpt").read_bytes()


def test_a_state_saved_by_2_ranks_loads_into_4_with_theta_and_e_unchanged(nodes) -> None:
    out = nodes["out"]
    facts = json.loads((out / "t4.json").read_text())
    saved = json.loads((out / "t2.json").read_text())
    assert facts["loaded"]["theta"] == saved["fingerprint"]
    assert facts["loaded"]["steps"] == 0  # AdamW of another layout starts fresh
    errors = _theta(out, "t4", 4, "loaded-error")
    # The 2-rank node saved e after encoding it (the residual); one process encoding the same
    # buffer kept the very same residual.
    single = load_file(str(out / "solo-state" / "state.safetensors"))
    assert set(errors) == {"e." + k.removeprefix("error.") for k in single}
    for key, value in single.items():
        assert torch.equal(errors["e." + key.removeprefix("error.")], value), key


def test_a_state_saved_by_ranks_loads_into_one_process(nodes, tmp_path: Path) -> None:
    w = _worker()
    pending, resumed = restore_state(Shard(nodes["out"] / "t4-state", Group.solo(), w))
    assert resumed and pending is None
    assert w.fingerprint() == json.loads((nodes["out"] / "t4.json").read_text())["fingerprint"]
    errors = _theta(nodes["out"], "t4", 4, "loaded-error")
    for name, t in w.error.items():
        assert torch.equal(t, errors[f"e.{name}"]), name


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp_inner_steps_train_what_one_process_trains(nodes, world) -> None:
    out = nodes["out"]
    one = json.loads((out / "solo.json").read_text())["losses"]
    many = json.loads((out / f"t{world}.json").read_text())["losses"]
    assert many == pytest.approx(one, rel=1e-5)
    reference = _theta(out, "solo", 1, "trained")
    sharded = _theta(out, f"t{world}", world, "trained")
    initial = _worker().params
    for name, value in reference.items():
        assert not torch.equal(value, initial[name]), name  # it trained
        torch.testing.assert_close(sharded[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_merge_inside_a_step_on_fsdp_trains_what_one_process_trains(nodes, world) -> None:
    # θ after the merge is bit for bit the single process's (and the plain apply's); the
    # parameters trained through it agree to rounding, as FSDP's inner steps do.
    out = nodes["out"]
    one = json.loads((out / "solo.json").read_text())
    many = json.loads((out / f"t{world}.json").read_text())
    assert one["merged"] == [[FLIPPED]]  # merged once, the hostile peer screened out
    assert many["merged"] == one["merged"]
    assert one["merge_fingerprint"] == one["fingerprint"]
    assert many["merge_fingerprint"] == one["fingerprint"]
    assert many["merge_losses"] == pytest.approx(one["merge_losses"], rel=1e-5)
    reference = _theta(out, "solo", 1, "merged")
    sharded = _theta(out, f"t{world}", world, "merged")
    plain = _theta(out, "solo", 1, "trained")
    for name, value in reference.items():
        assert not torch.equal(value, plain[name]), name  # the merge moved the training
        torch.testing.assert_close(sharded[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_takes_rank_0s_word_at_the_merge(nodes, world) -> None:
    # Rank 0 waits for the transfers and tells the others: nothing came (every rank abandons,
    # θ untouched), θ is not the manifest's base (every rank abandons, rank 0 notes the
    # divergence), or the gather set (every rank merges its tensors: the plain apply's θ).
    one = json.loads((nodes["out"] / "solo.json").read_text())
    many = json.loads((nodes["out"] / f"t{world}.json").read_text())
    expected = [
        ["abandoned", False, True],
        ["abandoned", True, True],
        ["merged", [{}, [FLIPPED]], one["fingerprint"]],
    ]
    assert one["merge_word"] == expected
    assert many["merge_word"] == expected


def test_tensors_are_dealt_whole_and_balanced() -> None:
    shapes = model_shapes(get_preset("llama_1b"))
    for world in (2, 4, 8):
        owners = assign(shapes, world)
        assert set(owners) == set(shapes)
        assert sorted(n for r in range(world) for n in owned(shapes, world, r)) == sorted(shapes)
        # Within one tensor of the ideal share.
        largest = max(math.prod(s) for s in shapes.values())
        b = balance(shapes, world)
        assert max(b.loads) <= b.total / world + largest
    assert assign(shapes, 4) == assign(dict(reversed(list(shapes.items()))), 4)
