"""LLaMA-style models written for Hugging Face ``transformers`` (``node.tools.hf``): the
directory loads with ``AutoModelForCausalLM``, computes the logits ours computes and generates.
The export never holds the model whole: it verifies the downloaded file in chunks and writes the
folder from it one tensor at a time, with the checks and messages it always had."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from node.compute.model import ModelConfig, build_model, get_preset
from node.errors import CheckpointError
from node.tools.export import verify_checkpoint
from node.tools.hf import FileTensors, hf_name, write_hf
from node.tools.shards import train_bpe
from protocol.fingerprint import digest_file, fingerprint
from protocol.messages import CheckpointInfo
from protocol.runconfig import RunConfig, Timing
from support.cluster import Cluster

CORPUS = Path(__file__).resolve().parent.parent / "node" / "corpus"
UNTIED_GQA = ModelConfig(
    arch="llama",
    d_model=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=320,
    tie_embeddings=False,
    ctx_len=64,
)


@pytest.mark.parametrize("cfg", [get_preset("llama_tiny"), UNTIED_GQA], ids=["tied", "untied-gqa"])
def test_transformers_loads_the_export_and_agrees_with_our_model(
    tmp_path: Path, cfg: ModelConfig
) -> None:
    ours = build_model(cfg, seed=5).eval()
    params = {n: p.data for n, p in ours.named_parameters()}
    write_hf(params, cfg, tmp_path, {"run_id": "test"})
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(ids)
        got = theirs(ids).logits
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    generated = theirs.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
    assert generated.shape == (1, 16)
    assert torch.equal(generated[0, :8], ids[0, :8])


def test_a_gpt_run_is_refused_with_a_reason(tmp_path: Path) -> None:
    cfg = get_preset("tiny")
    params = {n: p.data for n, p in build_model(cfg, seed=0).named_parameters()}
    with pytest.raises(CheckpointError, match="only LLaMA-style models"):
        write_hf(params, cfg, tmp_path, {})
    assert not any(tmp_path.iterdir())


def test_sparseloco_export_of_a_llama_run_loads_in_transformers(tmp_path: Path, store) -> None:
    """A real run (SeaweedFS, coordinator, two nodes) of the LLaMA-style model with a checkpoint,
    then ``sparseloco export`` as a participant types it: the model and its (byte) tokenizer
    load and generate text. A ``--tokenizer`` larger than the model's vocabulary is refused
    before anything is written."""
    run = RunConfig(
        name="hf",
        model="llama_tiny",
        rounds=3,
        inner_steps=3,
        batch_size=2,
        min_nodes=2,
        checkpoint_every=2,
        retention_rounds=4,
        timing=Timing(first_round_s=120, min_round_s=60, max_round_s=120, heartbeat_timeout_s=30),
    )
    cluster = Cluster(tmp_path, store, run, 2)
    try:
        cluster.start_coordinator()
        for name in cluster.tokens:
            cluster.start_node(name)
        cluster.wait_finished()
        out = tmp_path / "model"
        env = {**os.environ, "SPARSELOCO_NODE_TOKEN": cluster.tokens["node-0"]}
        sparseloco = str(Path(sys.executable).parent / "sparseloco")
        export = [sparseloco, "export", "--coordinator", cluster.url]
        proc = subprocess.run(
            [*export, "--out", str(out)], env=env, capture_output=True, text=True, timeout=120
        )
        bpe = tmp_path / "bpe512.json"
        train_bpe([CORPUS / "lear_gut.txt"], "text", 512).save(str(bpe))
        refused = subprocess.run(
            [*export, "--out", str(tmp_path / "refused"), "--tokenizer", str(bpe)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        cluster.stop()
    assert proc.returncode == 0, proc.stderr[-2000:]
    document = json.loads((out / "run.json").read_text())
    assert document["format"] == "transformers" and document["round"] == 2
    assert document["tokenizer"] == "bytes (ids 0-255)"
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("To be, or", return_tensors="pt")
    assert prompt.input_ids[0].tolist() == list(b"To be, or")
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] <= prompt.input_ids.shape[1] + 5
    text = tokenizer.decode(generated[0])
    assert isinstance(text, str) and text.startswith("To be, or")
    assert refused.returncode != 0
    assert "512 entries" in refused.stderr and "vocabulary of 256" in refused.stderr, refused.stderr
    assert not (tmp_path / "refused").exists()


class OneAtATime(FileTensors):
    """``FileTensors`` that fails if the tensor it handed out last is still alive when the next
    one is asked for (a writer that kept them would hold the whole model)."""

    reads = 0
    last: weakref.ref[torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        gc.collect()
        assert self.last is None or self.last() is None, "the previous tensor is still held"
        t = super().__getitem__(name)
        self.reads += 1
        self.last = weakref.ref(t)
        return t


def test_the_folder_is_written_from_the_file_one_tensor_at_a_time(tmp_path: Path) -> None:
    params = {n: p.data for n, p in build_model(UNTIED_GQA, seed=3).named_parameters()}
    checkpoint = tmp_path / "checkpoint.safetensors"
    save_file(params, str(checkpoint))
    checked = digest_file(checkpoint)
    assert checked.fingerprint == fingerprint(params)
    source = OneAtATime(checkpoint, checked)
    write_hf(source, UNTIED_GQA, tmp_path / "streamed", {"run_id": "test"})
    assert source.reads == len(params)
    written = load_file(str(tmp_path / "streamed" / "model.safetensors"))
    assert written.keys() == {hf_name(n) for n in params}
    assert all(torch.equal(written[hf_name(n)], t) for n, t in params.items())
    # The same bytes as from the tensors in memory.
    write_hf(params, UNTIED_GQA, tmp_path / "in-memory", {"run_id": "test"})
    for name in ("model.safetensors", "config.json"):
        streamed = (tmp_path / "streamed" / name).read_bytes()
        assert streamed == (tmp_path / "in-memory" / name).read_bytes(), name


def _info(data: bytes, fp: str) -> CheckpointInfo:
    import hashlib

    sha = hashlib.sha256(data).hexdigest()
    return CheckpointInfo(
        run_id="run", round=4, fingerprint=fp, key="k", sha256=sha, size=len(data),
        node_id="node-0", created_at=0.0,
    )  # fmt: skip


def test_a_downloaded_checkpoint_is_checked_against_the_run(tmp_path: Path) -> None:
    """The file's names, shapes and dtypes against the run's model, then its fingerprint, each
    refusal with the message export always gave."""
    run = RunConfig(name="x", model="llama_tiny")
    params = {
        n: p.data for n, p in build_model(get_preset("llama_tiny"), seed=1).named_parameters()
    }
    good = tmp_path / "good.safetensors"
    save_file(params, str(good))
    fp = fingerprint(params)
    assert verify_checkpoint(good, _info(good.read_bytes(), fp), run).fingerprint == fp
    with pytest.raises(CheckpointError, match=f"has fingerprint {fp}, the nodes agreed on 0+$"):
        verify_checkpoint(good, _info(good.read_bytes(), "0" * 32), run)
    cases = {
        "missing": {n: t for n, t in list(params.items())[1:]},
        "half": {n: t.half() for n, t in params.items()},
        "reshaped": {n: t.reshape(-1) for n, t in params.items()},
    }
    for case, tensors in cases.items():
        path = tmp_path / f"{case}.safetensors"
        save_file(tensors, str(path))
        with pytest.raises(CheckpointError, match="does not hold the run's 'llama_tiny' model"):
            verify_checkpoint(path, _info(path.read_bytes(), fp), run)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match="checkpoint of round 4 is unreadable: data"):
        verify_checkpoint(cut, _info(cut.read_bytes(), fp), run)
