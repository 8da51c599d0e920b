"""HTTPS end to end, with real processes: a coordinator serving TLS itself and nodes given invites.

The certificate is self-signed and made in the test (``support.tls``). The operator issues an
invite with the real console script; a node that trusts the certificate (``--ca-cert``) joins
with nothing but the invite, pins the manifest key it names and finishes the run; one that does
not trust it, and ``doctor`` without it, stop at once with a message that says what to do.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from coordinator.state.signing import ManifestSigner
from node.cluster.launch import start_coordinator
from node.cluster.seaweed import EmbeddedStore
from node.daemon.pinning import PIN_FILE
from protocol.invite import decode_invite, key_fingerprint
from protocol.messages import RoundState
from protocol.runconfig import RunConfig
from protocol.status import StatusView
from support.harness import REPO_ROOT, write_coordinator_config
from support.tls import self_signed

SPARSELOCO = Path(sys.executable).parent / "sparseloco"


def sparseloco(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    # Only what the test passes: nothing of the developer's own SPARSELOCO_NODE_* settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSELOCO_NODE_")}
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    return subprocess.run(
        [str(SPARSELOCO), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env=env,
    )


def status(url: str, cert: Path) -> StatusView:
    context = ssl.create_default_context(cafile=str(cert))
    with urllib.request.urlopen(f"{url}/v1/status?rounds=100", context=context, timeout=10) as r:
        return StatusView.model_validate_json(r.read())


def test_a_node_with_an_invite_runs_over_https_and_an_untrusting_one_stops(
    store: EmbeddedStore, tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path / "tls")
    state = tmp_path / "coordinator"
    state.mkdir()
    run = RunConfig(name="tls", model="tiny", rounds=2, inner_steps=2, batch_size=4, min_nodes=1)
    config = write_coordinator_config(
        tmp_path / "run.toml",
        run=run,
        endpoint=store.endpoint,
        tokens={},
        prefix=f"tls-{tmp_path.name}",
        state_dir=state,
        server={"tls_cert": str(cert), "tls_key": str(key)},
    )
    proc, url = start_coordinator(config, state, tmp_path / "coordinator.log")
    try:
        assert url.startswith("https://127.0.0.1:")
        added = sparseloco(
            "coordinator", "token", "add", "node-0", "--config", str(config), "--invite"
        )
        assert added.returncode == 0, added.stderr
        text = added.stdout.strip()
        invite = decode_invite(text)
        public_key = ManifestSigner.load_or_create(state).public_key_hex
        assert invite.coordinator == url  # port 0 in [server]: the running coordinator's URL
        assert invite.manifest_key == key_fingerprint(public_key)
        assert invite.token not in added.stderr

        nodes = tmp_path / "nodes"
        untrusting = sparseloco("node", "--invite", text, "--state-dir", str(nodes / "a"))
        assert untrusting.returncode == 2, untrusting.stderr
        assert "presented a TLS certificate this machine does not trust" in untrusting.stderr
        assert "--ca-cert" in untrusting.stderr and "Traceback" not in untrusting.stderr
        assert not (nodes / "a" / PIN_FILE).exists()

        doctor = sparseloco("doctor", "--invite", text, timeout=120)
        assert doctor.returncode == 1
        assert "TLS certificate not trusted" in doctor.stdout and "--ca-cert" in doctor.stdout

        started = time.monotonic()
        args = ["--invite", text, "--ca-cert", str(cert), "--state-dir", str(nodes / "b")]
        node = sparseloco("node", *args, "--threads", "1")
        assert node.returncode == 0, node.stderr[-3000:]
        assert time.monotonic() - started < 200
        assert "source=invite" in node.stderr
        assert (nodes / "b" / PIN_FILE).read_text().strip() == public_key
        final = status(url, cert)
        assert final.state == RoundState.FINISHED
        assert [r.round for r in final.rounds if r.state == RoundState.CLOSED] == [0, 1]
    finally:
        proc.stop()
    log = (tmp_path / "coordinator.log").read_text()
    assert f"event=listening url={url}" in log


def test_a_bad_certificate_file_stops_the_coordinator_with_exit_2(
    store: EmbeddedStore, tmp_path: Path
) -> None:
    cert, _ = self_signed(tmp_path / "tls")
    config = write_coordinator_config(
        tmp_path / "run.toml",
        run=RunConfig(name="tls-bad"),
        endpoint=store.endpoint,
        tokens={},
        prefix="tls-bad",
        state_dir=tmp_path / "state",
        server={"tls_cert": str(cert), "tls_key": str(cert)},  # the certificate is not a key
    )
    proc = sparseloco("coordinator", "--config", str(config), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "server.tls_cert/tls_key: cannot load" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "state" / "coordinator.state.db").exists()  # nothing written


@pytest.mark.parametrize("half", ["tls_cert", "tls_key"])
def test_half_a_tls_pair_is_a_config_error(store: EmbeddedStore, tmp_path: Path, half: str) -> None:
    config = write_coordinator_config(
        tmp_path / "run.toml",
        run=RunConfig(name="tls-half"),
        endpoint=store.endpoint,
        tokens={},
        prefix="tls-half",
        state_dir=tmp_path / "state",
        server={half: "x.pem"},
    )
    proc = sparseloco("coordinator", "--config", str(config), timeout=60)
    assert proc.returncode == 2 and "set both tls_cert and tls_key" in proc.stderr
