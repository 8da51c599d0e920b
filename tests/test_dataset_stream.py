"""A run's dataset served from the object store: the coordinator's dataset endpoints against
the real store (SeaweedFS), the node's shard stream and fetcher, and ``sparseloco up`` on BPE
shards streamed by real node processes.

What must hold: the coordinator presigns the files the dataset's manifest lists and nothing
else; a node trusts the manifest only when it hashes to the id the run names, and a shard only
when it matches the manifest; each node downloads its own slot's shards (and the held-out ones
it evaluates on), never the whole dataset; honest nodes stay bit-identical.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from node.cluster.seaweed import EmbeddedStore
from node.compute.stream import RESIDENT, ShardStream
from node.daemon.dataset import ShardFetcher
from node.errors import Abandoned, DataError, RetriesExhausted
from node.tools.shards import prepare, upload
from protocol.dataset import DatasetManifest, ShardInfo
from protocol.runconfig import RunConfig, Timing

CORPUS = Path(__file__).parent.parent / "node" / "corpus"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def bytes_dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DatasetManifest]:
    """Byte-level shards of one play: 2,000 ids each, every 20th held out."""
    out = tmp_path_factory.mktemp("ds")
    manifest = prepare([str(CORPUS / "macbeth_gut.txt")], out, shard_tokens=2000)
    return out, manifest


def _upload(store: EmbeddedStore, root: Path, manifest: DatasetManifest, prefix: str) -> None:
    e = store.endpoint
    upload(
        root, manifest, endpoint=e.endpoint_url, bucket=e.bucket, prefix=prefix,
        credentials=(e.access_key, e.secret_key),
    )  # fmt: skip


# -- the node's stream and fetcher -------------------------------------------------------------


class FolderFetch:
    """A ``Fetch`` that copies shards from a prepared folder, recording what it was asked."""

    def __init__(self, source: Path, target: Path) -> None:
        self.source, self.target = source, target
        self.waited: list[str] = []
        self.ahead: list[str] = []

    def __call__(self, shards: Sequence[ShardInfo], *, wait: bool) -> None:
        (self.waited if wait else self.ahead).extend(s.name for s in shards)
        for s in shards:
            (self.target / s.name).parent.mkdir(parents=True, exist_ok=True)
            (self.target / s.name).write_bytes((self.source / s.name).read_bytes())


def test_a_stream_fetches_only_its_slots_shards_and_reads_ahead(
    tmp_path: Path, bytes_dataset: tuple[Path, DatasetManifest]
) -> None:
    root, manifest = bytes_dataset
    local = ShardStream(root, manifest, ctx_len=64)
    fetch = FolderFetch(root, tmp_path)
    remote = ShardStream(tmp_path, manifest, ctx_len=64, fetch=fetch)
    mine = {s.name for s in manifest.slot_shards(1, 3, 65)}
    for step in range(0, 200, 7):
        a = local.train_batch(worker=1, n_workers=3, step=step, batch_size=4, seed=5)
        b = remote.train_batch(worker=1, n_workers=3, step=step, batch_size=4, seed=5)
        assert all(map(lambda u, v: bool((u == v).all()), a, b))  # the same batches either way
    held = {s.name for s in manifest.shards if s.split == "eval"}
    assert set(fetch.waited) | set(fetch.ahead) <= mine  # its own shards, nothing else
    assert set(fetch.ahead) - set(fetch.waited), "the read-ahead fetched shards before use"
    on_disk = {f"shards/{p.name}" for p in (tmp_path / "shards").glob("*.bin")}
    assert on_disk <= mine and not on_disk & held
    assert [(x == y).all() for (x, _), (y, _) in zip(
        local.eval_batches(2, 4), remote.eval_batches(2, 4), strict=True
    )]  # fmt: skip
    assert held >= set(fetch.waited[-len(remote.eval_set_shards) :])
    assert len(remote._resident) <= RESIDENT


def test_a_damaged_shard_is_fetched_again_and_a_missing_one_without_a_fetcher_is_an_error(
    tmp_path: Path, bytes_dataset: tuple[Path, DatasetManifest]
) -> None:
    root, manifest = bytes_dataset
    fetch = FolderFetch(root, tmp_path)
    stream = ShardStream(tmp_path, manifest, ctx_len=64, fetch=fetch)
    first = stream.shard_at(worker=0, n_workers=1, step=0, batch_size=4)
    (tmp_path / first.name).parent.mkdir(parents=True)
    (tmp_path / first.name).write_bytes(b"\x00" * 4000)  # right size, wrong bytes
    x, _ = stream.train_batch(worker=0, n_workers=1, step=0, batch_size=4, seed=0)
    assert fetch.waited[0] == first.name and x.shape == (4, 64)
    bare = ShardStream(tmp_path / "empty", manifest, ctx_len=64)
    with pytest.raises(DataError, match="missing"):
        bare.train_batch(worker=0, n_workers=1, step=0, batch_size=4, seed=0)


class _Grant:
    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls


class _Api:
    async def dataset_files(self, names: list[str]) -> _Grant:
        return _Grant({n: n for n in names})


class _Transfers:
    """Serves shard bytes from a folder, after ``gate`` opens."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.gate = asyncio.Event()
        self.gets = 0

    async def get(self, url: str, *, size: int, sha256: str) -> bytes:
        await self.gate.wait()
        self.gets += 1
        data = (self.source / url).read_bytes()
        assert len(data) == size and hashlib.sha256(data).hexdigest() == sha256
        return data


@pytest.mark.asyncio
async def test_the_fetcher_downloads_once_evicts_old_shards_and_a_stop_ends_a_wait(
    tmp_path: Path, bytes_dataset: tuple[Path, DatasetManifest]
) -> None:
    root, manifest = bytes_dataset
    transfers = _Transfers(root)
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    api: Any = _Api()  # only what the fetcher calls
    fetcher = ShardFetcher(api, cast(Any, transfers), manifest, tmp_path, loop, stop, keep=3)
    train = manifest.train_shards()
    # A compute thread waiting for a shard the store does not deliver: a stop ends the wait.
    waiting = loop.run_in_executor(None, lambda: fetcher(train[:1], wait=True))
    await asyncio.sleep(0.2)
    stop.set()
    with pytest.raises(Abandoned):
        await waiting
    stop.clear()
    transfers.gate.set()
    # Two fetches of the same shards at once download each shard once.
    await asyncio.gather(fetcher.fetch(train[:2]), fetcher.fetch(train[:2]))
    assert transfers.gets == 2
    for start in range(2, 8, 2):
        await fetcher.fetch(train[start : start + 2])
    kept = sorted(p.name for p in (tmp_path / "shards").glob("*.bin"))
    assert len(kept) <= 3 and {s.name.removeprefix("shards/") for s in train[6:8]} <= set(kept)
    assert not list((tmp_path / "shards").glob("*.partial"))


# -- the whole system ----------------------------------------------------------------------------


def test_up_trains_a_llama_model_on_bpe_shards_streamed_from_the_store(tmp_path: Path) -> None:
    """The two commands of docs/commands.md, as typed there (in a folder where ``node/corpus``
    is the bundled corpus): ``sparseloco data prepare ... --train-bpe 4096`` then ``sparseloco
    up --preset llama_bpe --data ds``. The nodes stream their own shards from the run's store; each
    holds a few shards of its slot, none the whole dataset."""
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "corpus").symlink_to(CORPUS)
    doc = (Path(__file__).parent.parent / "docs" / "commands.md").read_text()
    prepare_line = (
        "sparseloco data prepare node/corpus --out ds --train-bpe 4096 --shard-tokens 16384"
    )
    up_line = "sparseloco up --preset llama_bpe --data ds --nodes 2 --rounds 3"
    assert prepare_line in doc and up_line in doc
    prep = subprocess.run(
        [str(BIN / "sparseloco"), *prepare_line.split()[1:]],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert prep.returncode == 0, prep.stderr[-3000:]
    data = tmp_path / "ds"
    manifest = DatasetManifest.model_validate_json((data / "manifest.json").read_bytes())
    out = tmp_path / "up.json"
    proc = subprocess.run(
        [str(BIN / "sparseloco"), *up_line.split()[1:], "--dir", "run", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["run"]["dataset"] == manifest.dataset_id
    assert result["run"]["model"] == "llama_bpe4k"
    assert result["fingerprints_agree"] is True
    assert [sorted(r["gather"]) for r in result["rounds"]] == [["node-0", "node-1"]] * 3
    assert result["final_eval_loss"] < 8.3  # ln(4096): below an untrained model's loss
    held = {s.name for s in manifest.shards if s.split == "eval"}
    train_sets = []
    slots = RunConfig().data_slots
    for node in ("node-0", "node-1"):
        folder = tmp_path / "run" / "nodes" / node / "datasets" / manifest.dataset_id[7:]
        files = {f"shards/{p.name}" for p in (folder / "shards").glob("*.bin")}
        train = files - held
        assert train and len(files) < len(manifest.shards) // 2, sorted(files)
        assert any(
            train <= {s.name for s in manifest.slot_shards(slot, slots)} for slot in range(slots)
        ), sorted(train)
        train_sets.append(train)
    assert not train_sets[0] & train_sets[1]  # two slots, two disjoint sets of shards


def test_a_late_joiner_streams_its_own_shards_and_export_ships_the_datasets_tokenizer(
    tmp_path: Path, store: EmbeddedStore
) -> None:
    """Real processes: two nodes start a run on a BPE dataset in the store, a third joins two
    rounds late and streams its own slot's shards; every node ends on one θ. Then
    ``sparseloco export``, with no ``--tokenizer``, ships the dataset's own tokenizer (fetched
    from the store and checked against the run's dataset id), and transformers generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from support.cluster import Cluster

    data = tmp_path / "data"
    plays = [str(CORPUS / "hamlet_gut.txt"), str(CORPUS / "othello_gut.txt")]
    manifest = prepare(plays, data, train_vocab=4096, shard_tokens=3000)
    run = RunConfig(
        name="stream", model="llama_bpe4k", dataset=manifest.dataset_id, rounds=5,
        inner_steps=4, batch_size=4, min_nodes=2, checkpoint_every=4, retention_rounds=6,
        timing=Timing(first_round_s=120, min_round_s=60, max_round_s=120, heartbeat_timeout_s=30),
    )  # fmt: skip
    cluster = Cluster(tmp_path, store, run, 3)
    _upload(store, data, manifest, cluster.prefix)
    try:
        cluster.start_coordinator()
        cluster.start_node("node-0")
        cluster.start_node("node-1")
        cluster.wait_for("round 2", lambda s: s.round >= 2)
        cluster.start_node("node-2")
        final = cluster.wait_finished()
        env = {**os.environ, "SPARSELOCO_NODE_TOKEN": cluster.tokens["node-0"]}
        out = tmp_path / "model"
        proc = subprocess.run(
            [str(BIN / "sparseloco"), "export", "--coordinator", cluster.url, "--out", str(out)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        doctor = subprocess.run(
            [str(BIN / "sparseloco"), "doctor", "--coordinator", cluster.url],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        cluster.stop()
    assert proc.returncode == 0, proc.stderr[-2000:]
    dataset_line = [line for line in doctor.stdout.splitlines() if "dataset" in line]
    assert dataset_line and "ok" in dataset_line[0] and "bpe tokens" in dataset_line[0], (
        doctor.stdout
    )
    last = final.rounds[-1]
    assert set(last.fingerprints) == {"node-0", "node-1", "node-2"}
    assert len(set(last.fingerprints.values())) == 1
    slots = {m.node_id: m.slot for m in final.members}
    held = {s.name for s in manifest.shards if s.split == "eval"}
    owned = {}
    for node, slot in slots.items():
        folder = tmp_path / "nodes" / node / "datasets" / manifest.dataset_id[7:] / "shards"
        owned[node] = {f"shards/{p.name}" for p in folder.glob("*.bin")} - held
        assert owned[node] <= {s.name for s in manifest.slot_shards(slot, run.data_slots)}
    assert owned["node-2"] and not owned["node-2"] & (owned["node-0"] | owned["node-1"])
    document = json.loads((out / "run.json").read_text())
    assert document["tokenizer"] == f"dataset {manifest.dataset_id}"
    tokenizer = AutoTokenizer.from_pretrained(out)
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(data / "tokenizer.json"))
    text = "To be, or not to be"
    assert tokenizer(text).input_ids == ours.encode(text).ids  # the ids the model trained on
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    prompt = tokenizer(text, return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    decoded = tokenizer.decode(generated[0])
    assert isinstance(decoded, str) and decoded.startswith(text)


class _Outage(_Transfers):
    """The store fails ``failures`` downloads (as after exhausted retries), then serves."""

    def __init__(self, source: Path, failures: int) -> None:
        super().__init__(source)
        self.gate.set()
        self.failures = failures

    async def get(self, url: str, *, size: int, sha256: str) -> bytes:
        if self.failures:
            self.failures -= 1
            raise RetriesExhausted("download: connection refused after 5 attempts")
        return await super().get(url, size=size, sha256=sha256)


@pytest.mark.asyncio
async def test_training_waits_out_a_store_outage_for_its_shard(
    tmp_path: Path, bytes_dataset: tuple[Path, DatasetManifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard the node needs now cannot be had while the store is down: the compute thread
    waits (fresh URLs each try) and trains on once it is back, instead of failing the node."""
    import node.daemon.dataset as dataset_module

    monkeypatch.setattr(dataset_module, "RETRY_MAX_S", 0.05)
    root, manifest = bytes_dataset
    transfers = _Outage(root, failures=3)
    api: Any = _Api()
    fetcher = ShardFetcher(
        api, cast(Any, transfers), manifest, tmp_path, asyncio.get_running_loop(),
        threading.Event(),
    )  # fmt: skip
    stream = ShardStream(tmp_path, manifest, ctx_len=64, fetch=fetcher)
    loop = asyncio.get_running_loop()
    x, _ = await loop.run_in_executor(
        None, lambda: stream.train_batch(worker=0, n_workers=1, step=0, batch_size=2, seed=0)
    )
    assert transfers.failures == 0 and transfers.gets >= 1 and x.shape == (2, 64)
