"""The final model a run folder keeps (``node.tools.offline``), and its export with nothing
running, on state files written the way a node writes them (``node.compute.state``).

The whole path through real processes (``sparseloco up --export``, then ``sparseloco export
--run``, loaded by transformers) is ``tests/test_network_run.py``; here the cases a short run
does not reach: a node of several processes (θ in one file per rank), a node whose state is
not the agreed θ, a kept file changed afterwards, a folder without a final model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from node.compute.files import write_safetensors
from node.compute.model import build_model, get_preset
from node.compute.state import STATE_FILE, STATE_VERSION
from node.errors import CheckpointError
from node.tools.offline import FINAL_DIR, MODEL_FILE, export_run, keep_final
from protocol.fingerprint import fingerprint
from protocol.runconfig import RunConfig

RUN = RunConfig(name="offline", model="tiny", rounds=3)


def _theta() -> dict[str, torch.Tensor]:
    model = build_model(get_preset(RUN.model), seed=1)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _node_state(
    state_dir: Path, theta: dict[str, torch.Tensor], world: int, fp: str, run: RunConfig = RUN
) -> None:
    """θ after the run's last round as a node of ``world`` processes leaves it."""
    state_dir.mkdir(parents=True)
    names = sorted(theta)
    for rank in range(world):
        mine = {n: theta[n] for n in names[rank::world]}
        suffix = "" if world == 1 else f".rank{rank}"
        path = state_dir / f"theta-{run.rounds}{suffix}.safetensors"
        write_safetensors(path, mine, {"round": str(run.rounds), "fingerprint": fp})
    header = {
        "version": STATE_VERSION,
        "run_id": run.run_id,
        "node_id": state_dir.name,
        "round": run.rounds,
        "phase": "idle",
        "fingerprint": fp,
        "world": world,
        "seq": 1,
    }
    write_safetensors(state_dir / STATE_FILE, {}, {"sparseloco": json.dumps(header)})


@pytest.mark.parametrize("world", [1, 2])
def test_the_agreed_theta_is_kept_and_exported_from_the_folder(tmp_path: Path, world) -> None:
    theta = _theta()
    agreed = fingerprint(theta)
    # node-0 stopped a round early (another θ); node-1 holds the agreed one
    stale = {n: t + 1 for n, t in theta.items()}
    _node_state(tmp_path / "nodes" / "node-0", stale, world, fingerprint(stale))
    _node_state(tmp_path / "nodes" / "node-1", theta, world, agreed)
    nodes = [tmp_path / "nodes" / f"node-{i}" for i in range(2)]

    final = keep_final(tmp_path, RUN, RUN.run_id, agreed, nodes)
    kept = json.loads((final / "final.json").read_text())
    assert (kept["node_id"], kept["round"], kept["fingerprint"]) == ("node-1", 3, agreed)

    out = tmp_path / "export"
    document = export_run(tmp_path, out)
    assert document["format"] == "safetensors" and document["fingerprint"] == agreed
    assert json.loads((out / "run.json").read_text())["run"] == RUN.model_dump(mode="json")
    loaded = load_file(str(out / MODEL_FILE))
    assert loaded.keys() == theta.keys()
    assert all(torch.equal(loaded[n], theta[n]) for n in theta)


def test_no_node_with_the_agreed_theta_keeps_nothing(tmp_path: Path) -> None:
    theta = _theta()
    _node_state(tmp_path / "nodes" / "node-0", theta, 1, fingerprint(theta))
    with pytest.raises(CheckpointError, match="final model was not kept"):
        keep_final(tmp_path, RUN, RUN.run_id, "0" * 32, [tmp_path / "nodes" / "node-0"])
    assert not (tmp_path / FINAL_DIR / MODEL_FILE).exists()


def test_a_changed_or_missing_final_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="holds no final model"):
        export_run(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    theta = _theta()
    agreed = fingerprint(theta)
    _node_state(tmp_path / "nodes" / "node-0", theta, 1, agreed)
    final = keep_final(tmp_path, RUN, RUN.run_id, agreed, [tmp_path / "nodes" / "node-0"])
    model = final / MODEL_FILE
    data = bytearray(model.read_bytes())
    data[-1] ^= 1
    model.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="changed since the run kept it"):
        export_run(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out" / MODEL_FILE).exists()


def test_a_run_on_a_prepared_dataset_exports_with_its_tokenizer(tmp_path: Path) -> None:
    """The run folder keeps the dataset's manifest and tokenizer.json: the offline export of a
    LLaMA-style BPE run is a transformers folder whose tokenizer is that one."""
    from node.tools.shards import prepare
    from support.harness import REPO_ROOT

    corpus = REPO_ROOT / "node" / "corpus" / "hamlet_gut.txt"
    data = tmp_path / "ds"
    manifest = prepare([str(corpus)], data, train_vocab=512, shard_tokens=20000)
    run = RunConfig(name="bpe", model="llama_bpe4k", rounds=1, dataset=manifest.dataset_id)
    model = build_model(get_preset(run.model), seed=0)
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = tmp_path / "run" / "nodes" / "node-0"
    _node_state(state, theta, 1, fingerprint(theta), run)
    keep_final(tmp_path / "run", run, run.run_id, fingerprint(theta), [state], str(data))
    document = export_run(tmp_path / "run", tmp_path / "out")
    assert document["format"] == "transformers"
    assert document["tokenizer"] == f"dataset {manifest.dataset_id}"
    kept = (tmp_path / "out" / "tokenizer.json").read_text()
    assert kept == (data / "tokenizer.json").read_text()
