"""The node's compute and its local state, without a network.

Two workers of one run train, exchange payloads as bytes and apply them: they must end
bit-identical, a payload that was not aggregated must go back into the error buffer whole, and
the state file must round-trip exactly and refuse to be used for another model.
"""

from __future__ import annotations

import pytest
import torch

from node.compute.state import load_state, save_state
from node.compute.worker import Worker, check_payload_header
from node.errors import StateError
from protocol.errors import PayloadError
from protocol.runconfig import RunConfig

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
