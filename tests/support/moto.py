"""moto's S3 server (``moto[server]``) as a second S3 implementation beside SeaweedFS.

``MotoStore`` starts ``python -m moto.server`` on a free loopback port in its own process group
and creates one bucket, with the same face as ``node.cluster.seaweed.EmbeddedStore`` where the
tests use it (``start``, ``stop``, ``endpoint``, ``client``). moto is functional only: it checks
no presigned signature, no signed length and no checksum (``sparseloco store check`` shows
exactly that), but keeps ``If-None-Match: *`` on PUT and on CompleteMultipartUpload, ranged GETs,
listings, multipart uploads and S3's 5 MiB part minimum.
"""

from __future__ import annotations

import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from node.cluster.process import Process
from node.cluster.seaweed import StoreEndpoint

#: Seconds moto's server may take to answer after start.
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class MotoStore:
    """moto's S3 server on loopback with one bucket."""

    def __init__(self, root: Path, *, bucket: str = "sparseloco") -> None:
        self.root = root
        self.bucket = bucket
        self.access_key = "moto-access-key"
        self.secret_key = "moto-secret-key-0123456789"
        self.port = 0
        self.process: Process | None = None

    @property
    def endpoint(self) -> StoreEndpoint:
        return StoreEndpoint(
            endpoint_url=f"http://127.0.0.1:{self.port}",
            bucket=self.bucket,
            access_key=self.access_key,
            secret_key=self.secret_key,
        )

    def client(self) -> Any:
        e = self.endpoint
        return boto3.client(
            "s3",
            endpoint_url=e.endpoint_url,
            aws_access_key_id=e.access_key,
            aws_secret_access_key=e.secret_key,
            region_name=e.region,
            config=Config(signature_version="s3v4"),
        )

    def start(self) -> StoreEndpoint:
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        args = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.process = Process("moto", args, self.root / "moto.log")
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto's server exited:\n{self.process.tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/moto-api/", timeout=2)
                break
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        else:
            self.stop()
            raise RuntimeError(f"moto's server did not answer within {START_TIMEOUT_S:.0f} s")
        self.client().create_bucket(Bucket=self.bucket)
        return self.endpoint

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            proc.stop(timeout=10)
