"""A local cluster for integration tests: real coordinator and node processes on loopback.

Built from the same pieces as ``sparseloco up`` (``node.cluster.launch``), but started one by one
so a test can add a node late, or kill and restart the coordinator on the same port. Every wait is
keyed to the run's progress as the coordinator reports it (rounds closed, run finished); the
timeouts are only a safety net against a hang. ``stop()`` ends every process the cluster started,
and the fixture calls it even when the test fails.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from node.cluster.launch import coordinator_toml, start_coordinator, start_node
from node.cluster.process import Process
from node.cluster.seaweed import EmbeddedStore, StoreEndpoint
from node.cluster.status import fetch_status
from node.research.bench.hostile import KINDS
from protocol.errors import ConfigError
from protocol.messages import RoundState
from protocol.runconfig import RunConfig
from protocol.signing import public_key_hex
from protocol.status import StatusView
from support.diverge import split_faults


class HasEndpoint(Protocol):
    """A store the cluster's coordinator is pointed at: its endpoint."""

    @property
    def endpoint(self) -> StoreEndpoint: ...


#: Safety net for any single wait; a healthy tiny run needs a small fraction of it.
WAIT_S = 240.0
#: A node's log line for a round it applied: the round and the fingerprint of θ after it.
APPLIED = r"event=applied node=\S+ .*?applied_round=(\d+) .*?fingerprint=(\w+)"

#: The folder that holds ``support``: on a wrapped node process's ``PYTHONPATH``.
TESTS = Path(__file__).resolve().parents[1]


class Cluster:
    def __init__(
        self,
        root: Path,
        store: EmbeddedStore | HasEndpoint,
        run: RunConfig,
        nodes: int,
        *,
        prefix: str | None = None,
        public_host: str | None = None,
        server: dict[str, Any] | None = None,
        storage: dict[str, Any] | None = None,
        wait_s: float = WAIT_S,
    ) -> None:
        """``public_host``: the coordinator listens on every address and nodes are told to reach
        it by this one (the WAN lab's service address), instead of loopback. ``server``: more
        settings of the coordinator's ``[server]`` table (``coordinator.base.config``), ``storage``
        of its ``[storage]`` table. ``store``: anything with the ``endpoint`` to use (another
        S3 implementation, a proxy in front of one).
        ``wait_s``: how long ``wait_for`` waits before it fails."""
        self.wait_s = wait_s
        self.root = root
        self.public_host = public_host
        self.run = run
        self.tokens = {f"node-{i}": secrets.token_urlsafe(12) for i in range(nodes)}
        self.state_dir = root / "coordinator"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # Runs with one config share a run id: the prefix keeps them apart in a shared store.
        self.prefix = prefix or f"it-{root.name}"
        self.config = root / "coordinator.toml"
        self.config.write_text(
            coordinator_toml(
                run,
                store.endpoint,
                self.tokens,
                self.state_dir,
                prefix=self.prefix,
                server={**({} if public_host is None else {"host": "0.0.0.0"}), **(server or {})},
                storage=storage,
            )
        )
        self.coordinator: Process | None = None
        self.url = ""
        self.nodes: dict[str, Process] = {}
        self.starts = 0

    def start_coordinator(self) -> None:
        port = self.port
        self.starts += 1
        self.coordinator, self.url = start_coordinator(
            self.config,
            self.state_dir,
            self.root / "logs" / f"coordinator-{self.starts}.log",
            port=port,
        )
        if self.public_host is not None:  # announced as http://0.0.0.0:PORT
            self.url = (
                urlparse(self.url)._replace(netloc=f"{self.public_host}:{self.port}").geturl()
            )

    @property
    def port(self) -> int:
        """The coordinator's port (0 before it first started)."""
        return urlparse(self.url).port or 0 if self.url else 0

    def kill_coordinator(self) -> None:
        if self.coordinator is not None:
            self.coordinator.kill()

    def start_node(
        self,
        name: str,
        faults: str | None = None,
        attack: str | None = None,
        ranks: int = 1,
        torchrun: bool = False,
    ) -> Process:
        """Start (or restart) a node; ``faults`` is its ``SPARSELOCO_FAULTS`` (a ``corrupt@R``
        among them starts it as ``support.diverge``'s diverging node); ``attack`` makes it a
        hostile node of that kind (``support.hostile``: the daemon with its seams wrapped);
        ``ranks`` > 1: one node of that many processes (``sparseloco node --ranks``; with
        ``torchrun``, under torchrun)."""
        env = {}
        faults, corrupt = split_faults(faults)
        if faults:
            env["SPARSELOCO_FAULTS"] = faults
        state_dir, log_path = self.root / "nodes" / name, self.root / "logs" / f"{name}.log"
        if corrupt or attack:  # the daemon wrapped by a module of tests/support, one process
            if ranks != 1 or (corrupt and attack):
                raise ValueError("a diverging or hostile node is one process, and only one of them")
            if attack and attack not in KINDS:
                raise ConfigError(f"hostile node {attack!r}: use one of {', '.join(KINDS)}")
            module, first = (
                ("support.diverge", ",".join(map(str, sorted(corrupt))))
                if corrupt
                else ("support.hostile_node", str(attack))
            )
            proc = self._start_wrapped(module, first, name, state_dir, log_path, env)
        else:
            proc = start_node(
                name, self.url, self.tokens[name], state_dir, log_path, None, env or None,
                ranks=ranks if ranks > 1 or torchrun else None, torchrun=torchrun,
            )  # fmt: skip
        self.nodes[name] = proc
        return proc

    def start_wrapped_node(self, name: str, module: str, first: str) -> Process:
        """Start ``python -m MODULE FIRST node ...`` as node ``name`` (a module of
        ``tests/support`` that wraps ``sparseloco node``, e.g. ``support.parts_node``)."""
        state_dir, log_path = self.root / "nodes" / name, self.root / "logs" / f"{name}.log"
        proc = self._start_wrapped(module, first, name, state_dir, log_path, {})
        self.nodes[name] = proc
        return proc

    def _start_wrapped(
        self, module: str, first: str, name: str, state_dir: Path, log_path: Path, env: dict
    ) -> Process:
        """``python -m MODULE FIRST node ...``, started as ``node.cluster.launch.start_node``
        starts an honest node (one thread, on the CPU), with ``tests/`` on its path."""
        args = [sys.executable, "-m", module, first, "node", "--coordinator", self.url]
        args += ["--state-dir", str(state_dir), "--threads", "1", "--device", "cpu"]
        full = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        full.pop("SPARSELOCO_FAULTS", None)
        full.update(env, SPARSELOCO_NODE_TOKEN=self.tokens[name])
        full["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), full.get("PYTHONPATH")) if p)
        return Process(name, args, log_path, env=full)

    def public_key(self) -> str:
        """The coordinator's manifest public key (hex), read from its signing key file."""
        pem = (self.state_dir / "manifest-key.pem").read_bytes()
        key = load_pem_private_key(pem, None)
        assert isinstance(key, Ed25519PrivateKey)
        return public_key_hex(key)

    def applied_fingerprints(self, node: str) -> dict[int, str]:
        """round -> fingerprint of θ after it, as ``node`` logged applying it (replays
        included: a node reports only the rounds it took part in, but logs every round it
        applies)."""
        text = (self.root / "logs" / f"{node}.log").read_text()
        found = re.findall(
            r"event=applied node=\S+ .*?applied_round=(\d+) .*?fingerprint=(\w+)", text
        )
        return {int(r): fp for r, fp in found}

    def status(self) -> StatusView:
        return fetch_status(self.url)

    def wait_for(self, what: str, predicate: Callable[[StatusView], bool]) -> StatusView:
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            for name, proc in self.nodes.items():
                code = proc.poll()
                if code not in (None, 0):
                    raise AssertionError(f"{name} exited with {code}:\n{proc.tail(40)}")
            try:
                status = self.status()
                if predicate(status):
                    return status
            except (urllib.error.URLError, OSError):
                pass  # the coordinator is restarting
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; logs in {self.root / 'logs'}")

    def wait_closed(self, rounds: int) -> StatusView:
        return self.wait_for(f"{rounds} closed rounds", lambda s: closed_count(s) >= rounds)

    def wait_finished(self) -> StatusView:
        """The run finished, every node exited 0 and reported the last round."""
        last = self.run.rounds - 1

        def done(status: StatusView) -> bool:
            if status.state != RoundState.FINISHED:
                return False
            return not any(p.poll() is None for p in self.nodes.values())

        status = self.wait_for("the run to finish", done)
        for name, proc in self.nodes.items():
            assert proc.poll() == 0, f"{name} exited with {proc.poll()}:\n{proc.tail(40)}"
        final = [r for r in status.rounds if r.round == last]
        assert final and final[0].state == RoundState.CLOSED
        return status

    def stop(self) -> None:
        for proc in self.nodes.values():
            proc.stop(timeout=20)
        if self.coordinator is not None:
            self.coordinator.stop(timeout=20)


def closed_count(status: StatusView) -> int:
    return sum(1 for r in status.rounds if r.state == RoundState.CLOSED)
