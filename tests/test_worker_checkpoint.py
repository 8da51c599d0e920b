"""Checkpoints, the error-feedback mass account and fault injection, without a network."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from node.compute.checkpoint import load_checkpoint_file, write_checkpoint_file
from node.compute.worker import Worker
from node.daemon.faults import Faults
from node.errors import CheckpointError
from protocol.errors import ConfigError
from protocol.fingerprint import fingerprint, fingerprint_safetensors
from protocol.runconfig import RunConfig
from support.diverge import flip_one_bit

RUN = RunConfig(model="tiny", rounds=4, inner_steps=2, batch_size=2)


def _worker(node: str = "n0", slot: int = 0) -> Worker:
    return Worker(
        RUN, run_id=RUN.run_id, node_id=node, slot=slot, eval_batches=1, eval_batch_size=2
    )


def test_checkpoint_round_trips_and_is_verified(tmp_path: Path) -> None:
    a, b = _worker(), _worker("n1", 1)
    a.train_and_compress()
    a.apply({"n0": a.read(a.train_and_compress().payload)})
    path = tmp_path / "ckpt.safetensors"
    size, sha256, fp = write_checkpoint_file(a, path)
    data = path.read_bytes()
    assert fp == a.fingerprint() and sha256 == hashlib.sha256(data).hexdigest()
    assert size == len(data) and fingerprint_safetensors(data) == fp
    load_checkpoint_file(b, path, round_=a.round, expected=fp)
    assert b.fingerprint() == a.fingerprint() and b.round == a.round
    with pytest.raises(CheckpointError, match="fingerprint"):
        load_checkpoint_file(b, path, round_=1, expected="0" * 32)
    path.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint_file(b, path, round_=1, expected=fp)
    b.reset_to_initial()
    assert b.round == 0 and b.fingerprint() == _worker().fingerprint()


@pytest.mark.parametrize("gathered", [True, False])
def test_mass_is_conserved_whether_or_not_the_payload_is_gathered(gathered: bool) -> None:
    w = _worker()
    result = w.train_and_compress()
    if gathered:
        w.apply({"n0": w.read(result.payload)})
        sent = w.sent_mass(result.recon)
    else:
        w.apply({})
        w.return_own(result.recon)
        sent = 0.0
    held = w.held_mass()
    assert result.scale > 0
    assert abs(result.computed - sent - held) <= 1e-5 * result.scale
    if gathered:
        assert abs(sent) > 0  # something real was sent, so the check is not vacuous


def test_a_flipped_bit_changes_the_fingerprint() -> None:
    w = _worker()
    before = w.fingerprint()
    flip_one_bit(w)  # the tests' diverging node (support.diverge)
    assert w.fingerprint() != before


def test_faults_parse_and_fire_once() -> None:
    f = Faults.parse("crash:mid_upload@3, slow:2.5@4")
    assert f.crash == {3: "mid_upload"} and f.slow == {4: 2.5}
    assert f.slow_for(4) == 2.5 and f.slow_for(4) == 0.0
    f.crash_point(3, "after_train")  # another point: nothing happens
    assert Faults.parse(None).crash == {}
    for bad in ("crash:nowhere@1", "explode@2", "slow:x@1", "corrupt@5"):
        with pytest.raises(ConfigError, match="SPARSELOCO_FAULTS"):
            Faults.parse(bad)


def test_the_encoders_recon_is_what_the_payload_decodes_to() -> None:
    # ĉ is kept from the encoder instead of decoding the own payload; they must be the same bits.
    w = _worker()
    result = w.train_and_compress()
    w.forget(0)  # as a restart loses it
    decoded = w.own_recon(0, result.payload)
    assert set(decoded) == set(result.recon)
    for name, t in result.recon.items():
        assert torch.equal(t, decoded[name])
    assert result.sha256 == hashlib.sha256(result.payload).hexdigest()


def test_the_remembered_fingerprint_follows_every_change_of_theta(tmp_path: Path) -> None:
    w, other = _worker(), _worker("n1", 1)

    def fresh() -> str:
        return fingerprint(w.params)

    assert w.fingerprint() == fresh()
    result = w.train_and_compress()  # trains, then puts θ_round back bit for bit
    assert result.base == w.fingerprint() == fresh()
    w.apply({"n0": w.read(result.payload)})
    assert w.fingerprint() == fresh() != result.base
    _, _, fp = write_checkpoint_file(w, tmp_path / "ckpt")
    load_checkpoint_file(other, tmp_path / "ckpt", round_=w.round, expected=fp)
    assert other.fingerprint() == fp == fingerprint(other.params)
    flip_one_bit(w)
    assert w.fingerprint() == fresh() != fp
    w.restore(other.snapshot())
    assert w.fingerprint() == fresh() == fp
    w.reset_to_initial()
    assert w.fingerprint() == fresh() == _worker().fingerprint()
