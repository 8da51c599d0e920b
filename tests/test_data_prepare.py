"""``sparseloco data prepare`` (``node.tools.shards``): text into shards of token ids with a
manifest, every kind of input, both tokenizers, bad input refused, and the upload to a real
S3-compatible store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from node.compute.data import open_corpus
from node.compute.stream import ShardStream
from node.compute.worker import Worker
from node.errors import DataError
from node.tools.shards import DatasetManifest, prepare, read_shard
from protocol.errors import ConfigError
from protocol.runconfig import RunConfig

CORPUS = Path(__file__).resolve().parent.parent / "node" / "corpus"
SPARSELOCO = Path(sys.executable).parent / "sparseloco"


def ids_of(out: Path, manifest: DatasetManifest) -> np.ndarray:
    return np.concatenate([read_shard(out / s.name, manifest, s) for s in manifest.shards])


def test_bytes_shards_hold_the_text_with_one_held_out(tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("to be or not to be\n" * 500)
    m = prepare([str(src)], tmp_path / "out", shard_tokens=1000)
    ids = ids_of(tmp_path / "out", m)
    assert bytes(ids.astype(np.uint8)) == src.read_bytes() + b"\n"  # the end-of-text id
    assert [s.tokens for s in m.shards] == [1000] * 9 + [501]
    assert [s.split for s in m.shards].count("eval") == 1 and m.shards[0].split == "eval"
    again = prepare([str(src)], tmp_path / "again", shard_tokens=1000)
    assert again.dataset_id == m.dataset_id  # the same input, the same dataset id


def test_a_trained_bpe_decodes_its_shards_back_to_the_text(tmp_path: Path) -> None:
    out = tmp_path / "out"
    m = prepare([str(CORPUS / "hamlet_gut.txt")], out, train_vocab=1024, shard_tokens=5000)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert m.tokenizer.kind == "bpe" and m.tokenizer.vocab_size == 1024 == tok.get_vocab_size()
    assert m.dtype == "uint16" and len(m.shards) > 2
    ids = ids_of(out, m).tolist()
    assert max(ids) < 1024 and ids[-1] == m.tokenizer.eot_id
    text = tok.decode(ids[:-1], skip_special_tokens=False)
    assert text == (CORPUS / "hamlet_gut.txt").read_text(encoding="utf-8", errors="replace")
    # A BPE compresses: fewer ids than bytes.
    assert m.total_tokens < 0.6 * (CORPUS / "hamlet_gut.txt").stat().st_size


def test_jsonl_rows_are_documents_and_a_bad_row_says_where(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"body": "first"}) + "\n\n" + json.dumps({"body": "second"}) + "\n")
    m = prepare([str(rows)], tmp_path / "out", column="body", shard_tokens=100)
    assert bytes(ids_of(tmp_path / "out", m).astype(np.uint8)) == b"first\nsecond\n"
    with pytest.raises(ConfigError, match=r"rows.jsonl:1: expected a JSON object with a 'text'"):
        prepare([str(rows)], tmp_path / "other")


def test_a_changed_shard_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    m = prepare([str(CORPUS / "tempest_gut.txt")], out, shard_tokens=50_000)
    shard = out / m.shards[1].name
    data = bytearray(shard.read_bytes())
    data[7] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="sha256 does not match"):
        read_shard(shard, m, m.shards[1])


def test_the_command_refuses_bad_input_with_its_reason(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(SPARSELOCO), "data", "prepare", str(tmp_path / "missing.txt"), "--out", "x"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "no such file, directory or matching glob" in proc.stderr
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_the_command_uploads_a_dataset_to_the_store(tmp_path: Path, store, s3) -> None:
    ep = store.endpoint
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ep.access_key, "AWS_SECRET_ACCESS_KEY": ep.secret_key}
    proc = subprocess.run(
        [str(SPARSELOCO), "data", "prepare", str(CORPUS / "macbeth_gut.txt"), "--out",
         str(tmp_path / "ds"), "--train-bpe", "512", "--shard-tokens", "20000", "--upload",
         "--endpoint-url", ep.endpoint_url, "--bucket", ep.bucket, "--prefix", "runs/x"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = DatasetManifest.model_validate_json((tmp_path / "ds" / "manifest.json").read_text())
    root = f"runs/x/datasets/{m.dataset_id.removeprefix('sha256:')}"
    assert f"uploaded to s3://{ep.bucket}/{root}/\n" in proc.stdout  # one slash at the end
    assert "botocore" not in proc.stderr and " INFO " not in proc.stderr  # boto3's chatter
    listed = s3.list_objects_v2(Bucket=ep.bucket, Prefix=root + "/")
    keys = {o["Key"][len(root) + 1 :] for o in listed.get("Contents", [])}
    assert keys == {s.name for s in m.shards} | {"tokenizer.json", "manifest.json"}
    body = s3.get_object(Bucket=ep.bucket, Key=f"{root}/manifest.json")["Body"].read()
    assert DatasetManifest.model_validate_json(body).dataset_id == m.dataset_id


@pytest.fixture(scope="module")
def bpe_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    prepare([str(CORPUS / "hamlet_gut.txt")], out, train_vocab=1024, shard_tokens=4000)
    return out


def _inside(row: torch.Tensor, ids: np.ndarray) -> bool:
    """Whether ``row`` occurs as a contiguous run of ``ids``."""
    hay = torch.from_numpy(ids.astype(np.int64))
    return bool(hay.unfold(0, row.numel(), 1).eq(row).all(1).any())


def test_training_windows_come_from_the_slots_own_shards_and_evaluation_from_held_out_ones(
    bpe_dataset: Path,
) -> None:
    m = DatasetManifest.model_validate_json((bpe_dataset / "manifest.json").read_text())
    corpus = open_corpus(bpe_dataset, ctx_len=64, vocab_size=4096)
    assert isinstance(corpus, ShardStream)
    shard_ids = {s.name: read_shard(bpe_dataset / s.name, m, s) for s in m.shards}
    for slot in (0, 1):
        mine = {s.name for s in m.slot_shards(slot, 2, 65)}
        assert mine and all(m.shards[0].name != n for n in mine)  # shard 0 is held out
        for step in (0, 7, 123):
            x, y = corpus.train_batch(worker=slot, n_workers=2, step=step, batch_size=4, seed=0)
            assert x.shape == (4, 64) and int(x.max()) < 1024 and torch.equal(x[:, 1:], y[:, :-1])
            shard = corpus.shard_at(worker=slot, n_workers=2, step=step, batch_size=4)
            assert shard.name in mine
            rows = torch.cat([x, y[:, -1:]], 1)  # each window whole: x and y's last id
            assert all(_inside(r, shard_ids[shard.name]) for r in rows)
    held = [shard_ids[s.name] for s in m.shards if s.split == "eval"]
    for x, _ in corpus.eval_batches(2, 4):
        assert all(any(_inside(r, ids) for ids in held) for r in x)


def test_a_dataset_larger_than_the_model_vocabulary_is_refused(bpe_dataset: Path) -> None:
    with pytest.raises(DataError, match="1,024 entries, the model's 256"):
        open_corpus(bpe_dataset, ctx_len=64, vocab_size=256)


def test_a_llama_node_trains_a_round_on_bpe_shards(bpe_dataset: Path) -> None:
    run = RunConfig(model="llama_bpe4k", rounds=2, inner_steps=2, batch_size=2)
    w = Worker(
        run, run_id=run.run_id, node_id="n0", slot=0, data=str(bpe_dataset),
        eval_batches=1, eval_batch_size=2,
    )  # fmt: skip
    before = w.evaluate()
    result = w.train_and_compress()
    w.apply({"n0": w.read(result.payload)})
    assert w.round == 1 and 0 < before < 9.0  # ln(4096) ≈ 8.3 for an untrained model
