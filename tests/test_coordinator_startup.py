"""Start-up checks: a bad port or store fails at once, clearly, before anything is written.

The checks run against the session's SeaweedFS store with wrong credentials, a missing bucket
and a closed port; the process tests run ``python -m coordinator`` and look at what an operator
sees: the exit status, one line on stderr, no secret in it, and no state directory left behind.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.base.errors import StartupError
from coordinator.base.redact import SecretFilter
from coordinator.ops.preflight import check_store, listen_socket
from coordinator.store.storage import S3Store
from node.cluster.seaweed import EmbeddedStore, StoreEndpoint
from protocol.runconfig import RunConfig
from support.harness import REPO_ROOT, write_coordinator_config

SECRET_TOKEN = "node-token-that-must-never-show-0001"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def s3(endpoint: StoreEndpoint) -> S3Store:
    return S3Store(
        endpoint_url=endpoint.endpoint_url,
        bucket=endpoint.bucket,
        access_key=endpoint.access_key,
        secret_key=endpoint.secret_key,
        region=endpoint.region,
    )


async def refusal(endpoint: StoreEndpoint) -> str:
    with pytest.raises(StartupError) as info:
        await check_store(s3(endpoint), endpoint=endpoint.endpoint_url, prefix="p", run_id="r-1")
    return str(info.value)


@pytest.mark.asyncio
async def test_store_checks_name_the_problem(store: EmbeddedStore) -> None:
    good = store.endpoint
    await check_store(s3(good), endpoint=good.endpoint_url, prefix="p", run_id="r-1")
    wrong_secret = dataclasses.replace(good, secret_key="not-the-secret-key-1234")
    message = await refusal(wrong_secret)
    assert "refused the credentials" in message and "storage.secret_key" in message
    assert "not-the-secret-key-1234" not in message
    message = await refusal(dataclasses.replace(good, bucket="no-such-bucket-here"))
    assert "bucket 'no-such-bucket-here' does not exist" in message
    closed = dataclasses.replace(good, endpoint_url=f"http://127.0.0.1:{free_port()}")
    message = await refusal(closed)
    assert message.startswith("cannot reach the object store") and "endpoint_url" in message


def test_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartupError, match=f"port {port} on 127.0.0.1 is already in use"):
            listen_socket("127.0.0.1", port)
    with pytest.raises(StartupError, match="not an address of this machine"):
        listen_socket("192.0.2.1", 0)  # TEST-NET-1: never local


def _start(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator", "--config", str(config), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _config(tmp_path: Path, endpoint: StoreEndpoint, state: Path) -> Path:
    return write_coordinator_config(
        tmp_path / "run.toml",
        run=RunConfig(name="startup"),
        endpoint=endpoint,
        tokens={"n0": SECRET_TOKEN},
        prefix="startup-test",
        state_dir=state,
    )


def test_process_refuses_a_busy_port_before_writing_state(
    store: EmbeddedStore, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    config = _config(tmp_path, store.endpoint, state)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = _start(config, "--port", str(taken.getsockname()[1]))
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "already in use" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not state.exists()  # no database, no signing key


def test_process_refuses_wrong_credentials_without_showing_them(
    store: EmbeddedStore, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    wrong = dataclasses.replace(store.endpoint, secret_key="wrong-secret-key-0123456789")
    proc = _start(_config(tmp_path, wrong, state), "--port", "0")
    assert proc.returncode == 1, proc.stderr
    assert "refused the credentials" in proc.stderr and "Traceback" not in proc.stderr
    for secret in (wrong.secret_key, wrong.access_key, SECRET_TOKEN):
        assert secret not in proc.stderr and secret not in proc.stdout
    assert not state.exists()


def test_the_log_filter_masks_secrets(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("sparseloco.test.redact")
    handler = caplog.handler
    handler.addFilter(SecretFilter(["s3cr3t-value-123", "short"]))
    try:
        log.warning("event=x key=%s url=%s", "s3cr3t-value-123", "http://h/?k=s3cr3t-value-123")
        try:
            raise ValueError("boom s3cr3t-value-123")
        except ValueError:
            log.exception("event=y")
    finally:
        handler.filters.clear()
    assert "s3cr3t-value-123" not in caplog.text
    assert "event=x key=*** url=http://h/?k=***" in caplog.text
    assert "boom ***" in caplog.text
