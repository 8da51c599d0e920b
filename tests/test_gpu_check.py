"""``tests/bench/gpu_check.py --smoke``: the GPU check script itself works, on the CPU.

The check is meant for a machine with a GPU, where it runs rarely; its smoke mode runs every
part of it here (the device codec against the CPU's on the ``tiny`` shapes, then a real run of
three ``sparseloco node`` processes on ``llama_tiny``, all with ``--device cpu``, then a node
of one process under ``--ranks 1`` beside one of two) and writes the same JSON summary to
``$OUT``: every round closed with one fingerprint on every node, and every node's round reports
carry its tokens/s (no MFU on the CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.harness import REPO_ROOT

SCRIPT = REPO_ROOT / "tests" / "bench" / "gpu_check.py"


def test_the_gpu_check_runs_end_to_end_in_its_cpu_mode(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OUT=str(out))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"],
        cwd=tmp_path,  # its run folder goes under runs/ here
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: OK" in proc.stdout
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["ok"] and summary["codec"]["ok"] and summary["device"] == "cpu"
    # The mixture of experts: trained a few steps, its payload the same on both encoders, its
    # export to Mixtral loading with our logits (llama_moe here; 645M-A273M on a GPU).
    moe = summary["moe"]
    assert moe["ok"] and moe["model"] == "llama_moe" and moe["payload_identical"]
    assert moe["losses"][-1] < moe["losses"][0] and moe["export_max_logit_diff"] <= 1e-4
    nodes = summary["nodes"]
    assert nodes["ok"] and nodes["model"] == "llama_tiny" and nodes["failures"] == []
    assert nodes["devices"] == ["cpu", "cpu", "cpu"]
    names = ["node-0", "node-1", "node-2"]
    assert [r["round"] for r in nodes["rounds"]] == [0, 1]
    for entry in nodes["rounds"]:
        assert sorted(entry["fingerprints"]) == names
        assert len(set(entry["fingerprints"].values())) == 1
        assert sorted(entry["throughput"]) == names
        for speed in entry["throughput"].values():
            assert speed["tokens_per_s"] > 0 and speed["mfu"] is None
    for node in nodes["per_node"].values():
        assert node["tokens_per_s"] > 0 and node["mfu"] is None
    assert nodes["fallback"] is None
    log = (out / "gpu_nodes-logs" / "node-0.log").read_text()  # the logs come back with it
    assert "event=device device=cpu requested=cpu" in log
    assert "event=trained node=node-0 round=1" in log and "tokens_per_s=" in log
    assert not list((tmp_path / "runs").iterdir())  # its temporary run folders are gone
    # The sharded part: a node of one process under --ranks 1 (its outer state on its device,
    # here the CPU) beside a node of 2 processes, agreeing every round.
    ranked = summary["ranked"]
    assert ranked["ok"] and ranked["failures"] == [] and ranked["model"] == "llama_tiny"
    assert ranked["devices"] == ["cpu x1", "cpu x2"]
    for entry in ranked["rounds"]:
        assert sorted(entry["fingerprints"]) == ["node-0", "node-1"]
        assert len(set(entry["fingerprints"].values())) == 1
    ranked_log = (out / "gpu_ranked-logs" / "node-1.log").read_text()
    assert "event=rank_ready rank=1 world=2" in ranked_log
    # node-0 is a node of one rank (before, `up` started it as a plain process, whose outer
    # state stays on the CPU: the device path this part exists for never ran).
    one = (out / "gpu_ranked-logs" / "node-0.log").read_text()
    assert "event=rank_ready rank=0 world=1" in one
