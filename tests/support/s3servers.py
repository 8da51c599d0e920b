"""Second S3 implementations beside SeaweedFS: moto's server and MiniStack.

Each starts on a free loopback port in its own process group, with one bucket, and has the face
of ``node.cluster.seaweed.EmbeddedStore`` where the tests use it (``start``, ``stop``,
``endpoint``, ``client``):

- ``MotoStore``: ``python -m moto.server`` (``moto[server]``, a test dependency). Functional
  only: it checks no presigned signature, no signed length and no checksum (``sparseloco store
  check`` shows exactly that), but keeps ``If-None-Match: *`` on PUT and on
  CompleteMultipartUpload, ranged GETs, listings, multipart uploads and S3's 5 MiB part minimum.
- ``MiniStackStore``: ``ministack`` (a local AWS emulator). It pins a botocore older than ours,
  so it lives in a virtual environment of its own, ``.venv-ministack`` at the repository root,
  which ``ensure_ministack`` creates on first use (``pip install ministack==MINISTACK``, a few
  seconds from the package index) and reuses afterwards.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from node.cluster.process import Process
from node.cluster.seaweed import StoreEndpoint

#: Seconds a server may take to answer after start.
START_TIMEOUT_S = 60.0
#: The MiniStack release the tests run.
MINISTACK = "1.5.33"
#: Its virtual environment.
MINISTACK_VENV = Path(__file__).resolve().parents[2] / ".venv-ministack"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ServerStore:
    """An S3 server process on loopback with one bucket (``command`` says which)."""

    name = "s3"
    access_key = "test-access-key"
    secret_key = "test-secret-key-0123456789"

    def __init__(self, root: Path, *, bucket: str = "sparseloco") -> None:
        self.root = root
        self.bucket = bucket
        self.port = 0
        self.process: Process | None = None

    def command(self, port: int) -> tuple[Sequence[str], Mapping[str, str]]:
        raise NotImplementedError

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
        args, env = self.command(self.port)
        self.process = Process(
            self.name, args, self.root / f"{self.name}.log", env=env, cwd=self.root, own_group=True
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.process.tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/", timeout=2)
                break
            except urllib.error.HTTPError:
                break  # it answers
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        else:
            self.stop()
            raise RuntimeError(f"{self.name} did not answer within {START_TIMEOUT_S:.0f} s")
        self.client().create_bucket(Bucket=self.bucket)
        return self.endpoint

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            proc.stop(timeout=10)


class MotoStore(ServerStore):
    name = "moto"

    def command(self, port: int) -> tuple[Sequence[str], Mapping[str, str]]:
        args = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        return args, dict(os.environ)


def ensure_ministack(venv: Path = MINISTACK_VENV) -> Path:
    """The ``ministack`` program of its own virtual environment, created if missing."""
    program = venv / "bin" / "ministack"
    if program.exists():
        return program
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"ministack=={MINISTACK}"]
    done = subprocess.run(pip, capture_output=True, text=True)
    if done.returncode != 0 or not program.exists():
        raise RuntimeError(f"could not install ministack into {venv}:\n{done.stderr[-2000:]}")
    return program


class MiniStackStore(ServerStore):
    """MiniStack checks SigV4 signatures against the credentials in its own environment."""

    name = "ministack"

    def command(self, port: int) -> tuple[Sequence[str], Mapping[str, str]]:
        program = ensure_ministack()
        env = dict(
            os.environ,
            GATEWAY_PORT=str(port),
            AWS_ACCESS_KEY_ID=self.access_key,
            AWS_SECRET_ACCESS_KEY=self.secret_key,
        )
        return [str(program)], env
