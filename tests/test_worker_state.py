"""The node's compute and its local state, without a network.

Two workers of one run train, exchange payloads as bytes and apply them: they must end
bit-identical, a payload that was not aggregated must go back into the error buffer whole, and
the state file must round-trip exactly and refuse to be used for another model.
"""

from __future__ import annotations

import pytest
import torch

from node.compute.optim import adam_tensors
from node.compute.shards import check_payload_header
from node.compute.state import RankFiles, save_adam, save_state, save_theta
from node.compute.stateread import load_state
from node.compute.worker import Worker
from node.errors import StateError
from protocol.errors import PayloadError
from protocol.runconfig import RunConfig
from support.diverge import flip_one_bit

RUN = RunConfig(model="tiny", rounds=4, inner_steps=2, batch_size=2)


def _pair() -> list[Worker]:
    return [
        Worker(RUN, run_id=RUN.run_id, node_id=f"n{i}", slot=i, eval_batches=1, eval_batch_size=2)
        for i in range(2)
    ]


def test_two_workers_stay_bit_identical_and_lose_nothing() -> None:
    workers = _pair()
    assert workers[0].fingerprint() == workers[1].fingerprint()
    for _ in range(2):
        results = [w.train_and_compress() for w in workers]
        blobs = {w.node_id: r.payload for w, r in zip(workers, results, strict=True)}
        # n1's payload is left out of the gather set on purpose.
        for w in workers:
            payloads = {"n0": w.read(blobs["n0"])}
            before = {n: e.clone() for n, e in w.error.items()}
            w.apply(payloads)
            if w.node_id == "n1":
                w.return_own(results[1].recon)
                sent = w.read(blobs["n1"])
                for name, e in w.error.items():
                    added = e - before[name]
                    torch.testing.assert_close(added, sent.tensors[name].dense(), rtol=0, atol=1e-6)
        assert workers[0].fingerprint() == workers[1].fingerprint()
        assert workers[0].round == workers[1].round


def test_payload_header_must_match_the_manifest() -> None:
    w = _pair()[0]
    payload = w.read(w.train_and_compress().payload)
    check_payload_header(payload, run_id=RUN.run_id, round_=0, node_id="n0")
    with pytest.raises(PayloadError, match=r"header\.node"):
        check_payload_header(payload, run_id=RUN.run_id, round_=0, node_id="n1")
    with pytest.raises(PayloadError, match=r"header\.round"):
        check_payload_header(payload, run_id=RUN.run_id, round_=1, node_id="n0")


def test_state_round_trips_exactly(tmp_path) -> None:
    w = _pair()[0]
    w.train_and_compress()
    w.apply({})
    save_state(tmp_path, w.snapshot("idle"))
    fresh = _pair()[0]
    state = load_state(tmp_path, fresh.shapes)
    assert state is not None
    fresh.restore(state)
    assert fresh.fingerprint() == w.fingerprint()
    assert fresh.round == 1 and fresh.local_steps == w.local_steps
    for name in w.error:
        assert torch.equal(fresh.error[name], w.error[name])
    # The AdamW moments came back too: one more identical step gives identical parameters.
    fresh.train_and_compress()
    w.train_and_compress()
    for name in w.error:
        assert torch.equal(fresh.error[name], w.error[name])


def test_state_refuses_another_model_and_damage(tmp_path) -> None:
    w = _pair()[0]
    save_state(tmp_path, w.snapshot())
    with pytest.raises(StateError, match="does not match"):
        load_state(tmp_path, {"other": (3,)})
    (tmp_path / "state.safetensors").write_bytes(b"not a state file")
    with pytest.raises(StateError, match="unreadable"):
        load_state(tmp_path, w.shapes)
    assert load_state(tmp_path / "empty", w.shapes) is None


def test_the_state_files_are_plain_safetensors(tmp_path) -> None:
    """Written straight from the tensors' memory, the files are what ``safetensors`` reads:
    e in the state file with the header, θ and AdamW (step counts too) in their own files,
    every tensor and dtype back exactly."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    w = _pair()[0]
    w.train_and_compress()
    snapshot = w.snapshot("submitting")
    save_state(tmp_path, snapshot)
    state = load_file(str(tmp_path / "state.safetensors"))
    theta = load_file(str(tmp_path / "theta-0.safetensors"))
    adam = load_file(str(tmp_path / "adam-0.safetensors"))
    for name, t in snapshot.error.items():
        assert torch.equal(state["error." + name], t)
    for name, t in snapshot.theta.items():
        assert torch.equal(theta[name], t)
    for name, t in snapshot.adam.items():
        assert adam[name].dtype == t.dtype and torch.equal(adam[name], t)
    with safe_open(str(tmp_path / "state.safetensors"), framework="pt") as f:
        assert '"phase": "submitting"' in (f.metadata() or {})["sparseloco"]


def test_a_state_missing_its_latest_moments_restores_the_previous_ones(tmp_path) -> None:
    """AdamW is written behind: a state committed without its round's moments (killed in
    between) comes back with the newest older ones and their step count."""
    w = _pair()[0]
    w.train_and_compress()
    w.apply({})
    save_state(tmp_path, w.snapshot("idle"))  # round 1: θ_1, moments after 1 round
    steps = w.local_steps
    w.train_and_compress()
    w.apply({})
    newer = w.snapshot("idle")
    save_state(tmp_path, newer)
    (tmp_path / "adam-2.safetensors").unlink()
    older = _pair()[0]
    older.train_and_compress()
    save_adam(RankFiles(tmp_path), 1, adam_tensors(older.opt), steps)
    state = load_state(tmp_path, w.shapes)
    assert state is not None and state.round == 2 and state.local_steps == steps
    assert all(torch.equal(state.theta[n], t) for n, t in newer.theta.items())
    for name, t in adam_tensors(older.opt).items():
        assert torch.equal(state.adam[name], t)


def test_a_theta_file_of_another_state_is_refused(tmp_path) -> None:
    w = _pair()[0]
    save_state(tmp_path, w.snapshot("idle"))
    flip_one_bit(w)
    save_theta(RankFiles(tmp_path), 0, w.params, w.fingerprint())
    with pytest.raises(StateError, match="not the θ"):
        load_state(tmp_path, w.shapes)


def test_mass_sums_match_a_float64_reference(monkeypatch) -> None:
    """``total`` and ``abs_total`` against summing a float64 copy (chunk edges included)."""
    import node.compute.mass as worker_module

    monkeypatch.setattr(worker_module, "ABS_CHUNK", 7)
    gen = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randn(5, 9, generator=gen), "b": torch.randn(20, generator=gen)}
    want = sum(float(t.double().sum()) for t in tensors.values())
    want_abs = sum(float(t.double().abs().sum()) for t in tensors.values())
    assert worker_module.total(tensors) == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert worker_module.abs_total(tensors) == pytest.approx(want_abs, rel=1e-12)


def test_training_hands_theta_back_bit_for_bit() -> None:
    """After a round's training θ is θ_r again, exactly, and e moved by the pseudo-gradient."""
    w = _pair()[0]
    before = {n: t.clone() for n, t in w.params.items()}
    fp = w.fingerprint()
    w.train_and_compress()
    assert all(torch.equal(w.params[n], before[n]) for n in before)
    assert w.fingerprint() == fp
    assert any(e.abs().sum() > 0 for e in w.error.values())
