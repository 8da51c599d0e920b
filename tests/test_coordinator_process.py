"""The coordinator as a real process: start, serve a round, stop on SIGTERM, restart mid-run.

Runs ``python -m coordinator`` through ``tests/harness.py`` against the session's SeaweedFS store
and talks to it over HTTP with the standard library only, as any client would.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from node.cluster.seaweed import EmbeddedStore
from protocol.runconfig import RunConfig
from support.harness import REPO_ROOT, CoordinatorProcess, write_coordinator_config

TOKENS = {"n0": "process-test-token-n0", "n1": "process-test-token-n1"}
FP = "f" * 32


def call(url: str, method: str, path: str, node: str | None, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if node is not None:
        headers["Authorization"] = f"Bearer {TOKENS[node]}"
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def contribute(url: str, node: str, round_: int) -> dict[str, Any]:
    payload = f"{node}/{round_}".encode() * 8
    digest = hashlib.sha256(payload).hexdigest()
    status, grant = call(
        url, "POST", f"/v1/rounds/{round_}/upload", node, {"size": len(payload), "sha256": digest}
    )
    assert status == 200, grant
    put = urllib.request.Request(grant["url"], data=payload, method="PUT", headers=grant["headers"])
    with urllib.request.urlopen(put, timeout=60) as resp:
        assert resp.status == 200
    req = {"size": len(payload), "sha256": digest, "base_fingerprint": FP}
    status, resp_body = call(url, "POST", f"/v1/rounds/{round_}/submit", node, req)
    assert status == 200, resp_body
    return dict(resp_body)


def test_process_serves_stops_and_restarts(store: EmbeddedStore, tmp_path: Path) -> None:
    state = tmp_path / "state"
    run = RunConfig(name="proc", rounds=5, min_nodes=2)
    config = write_coordinator_config(
        tmp_path / "run.toml",
        run=run,
        endpoint=store.endpoint,
        tokens=TOKENS,
        prefix="proc-test",
        state_dir=state,
    )
    with CoordinatorProcess(config, state) as coord:
        assert coord.run_id == run.run_id
        for node in TOKENS:
            status, joined = call(coord.url, "POST", "/v1/join", node, {"client": "test"})
            assert status == 200, joined
        key = joined["manifest_public_key"]
        assert contribute(coord.url, "n0", 0)["accepted"]
        assert contribute(coord.url, "n1", 0)["accepted"]
        status, view = call(coord.url, "GET", "/v1/rounds/0/manifest?wait=30", "n0")
        assert status == 200
        first = view["signed"]
        assert contribute(coord.url, "n0", 1)["accepted"]  # round 1 is open, half submitted
        assert coord.terminate() == 0, coord.log()
        assert "event=stopped" in coord.log()
        assert not (state / "coordinator.json").exists()

    with CoordinatorProcess(config, state) as coord:
        assert coord.run_id == run.run_id
        status, again = call(coord.url, "GET", "/v1/rounds/0/manifest", "n1")
        assert again["signed"] == first  # closed stays closed, same manifest, same signature
        status, joined = call(coord.url, "POST", "/v1/join", "n1", {})
        assert joined["manifest_public_key"] == key  # the signing key survived the restart
        assert joined["round"]["round"] == 1 and joined["round"]["expected"]
        status, err = call(coord.url, "POST", "/v1/rounds/0/submit", "n0", {
            "size": 1, "sha256": "0" * 64, "base_fingerprint": FP,
        })  # fmt: skip
        assert (status, err["error"]) == (409, "round_closed")
        assert contribute(coord.url, "n1", 1)["accepted"]
        status, view = call(coord.url, "GET", "/v1/rounds/1/manifest?wait=30", "n0")
        assert status == 200
        assert [e["node_id"] for e in view["signed"]["manifest"]["gather"]] == ["n0", "n1"]
        status, st = call(coord.url, "GET", "/v1/status", None)
        assert [r["state"] for r in st["rounds"]] == ["closed", "closed", "open"]
        assert coord.terminate() == 0, coord.log()
    assert coord.log().count("event=round_closed round=0 ") == 1


def test_config_errors_exit_2_naming_the_field(store: EmbeddedStore, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\ngather_size = 0\n[server]\nstate_dir = "x"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator", "--config", str(bad)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "run.gather_size" in proc.stderr and "storage" in proc.stderr

    # A state directory of another run is refused, naming the fix.
    state = tmp_path / "state"
    refused: subprocess.CompletedProcess[str] | None = None
    for name in ("one", "two"):
        config = write_coordinator_config(
            tmp_path / f"{name}.toml",
            run=RunConfig(name=name),
            endpoint=store.endpoint,
            tokens=TOKENS,
            prefix="proc-test",
            state_dir=state,
        )
        refused = subprocess.run(
            [sys.executable, "-m", "coordinator", "--config", str(config), "--port", "0"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        ) if name == "two" else None  # fmt: skip
        if refused is None:
            with CoordinatorProcess(config, state) as coord:
                assert coord.terminate() == 0
    assert refused is not None and refused.returncode == 2
    assert "belongs to run one-" in refused.stderr and "--state-dir" in refused.stderr
