"""Starting a run's processes on this machine: the coordinator's config file, the coordinator,
and a node (one process, or several under torchrun), each a real child process.

``node.cluster.up`` starts a whole run from these; the integration tests, the chaos suite and
the WAN lab start their clusters piece by piece from the same functions, so every one of them
runs the processes a real deployment runs. The coordinator announces its address itself
(``coordinator.json`` in its state dir): ``start_coordinator`` waits for that, bounded by
``COORDINATOR_START_S``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from node.cluster.process import Process
from node.cluster.seaweed import StoreEndpoint
from node.errors import UpError
from protocol.runconfig import RunConfig

#: Seconds for the coordinator to write its address file after start.
COORDINATOR_START_S = 60.0


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))


def _toml_table(name: str, values: dict[str, Any]) -> list[str]:
    lines = [f"[{name}]"]
    nested = []
    for key, value in values.items():
        if isinstance(value, dict):
            nested.append((f"{name}.{key}", value))
        elif value is not None:
            lines.append(f"{json.dumps(key)} = {_toml_value(value)}")
    lines.append("")
    for sub, sub_values in nested:
        lines += _toml_table(sub, sub_values)
    return lines


def coordinator_toml(
    run: RunConfig,
    endpoint: StoreEndpoint,
    tokens: dict[str, str],
    state_dir: Path,
    *,
    prefix: str = "",
    server: dict[str, Any] | None = None,
    storage: dict[str, Any] | None = None,
) -> str:
    """The coordinator's config file for a local run (see ``deploy/run.example.toml``).

    ``server`` adds to or overrides the ``[server]`` table (loopback, any free port), ``storage``
    the ``[storage]`` table.
    """
    lines = _toml_table("run", run.model_dump(mode="json"))
    server_table = {"host": "127.0.0.1", "port": 0, "state_dir": str(state_dir), **(server or {})}
    lines += _toml_table("server", server_table)
    lines += _toml_table(
        "storage",
        {
            "endpoint_url": endpoint.endpoint_url,
            "bucket": endpoint.bucket,
            "prefix": prefix,
            "region": endpoint.region,
            "access_key": endpoint.access_key,
            "secret_key": endpoint.secret_key,
            **(storage or {}),
        },
    )
    lines += _toml_table("tokens", tokens)
    return "\n".join(lines)


def _quiet_env(threads: int = 1) -> dict[str, str]:
    """Few compute threads per process (one by default): N nodes share a few cores."""
    n = str(threads)
    return dict(os.environ, OMP_NUM_THREADS=n, NUMBA_NUM_THREADS=n, PYTHONUNBUFFERED="1")


def start_coordinator(
    config_path: Path,
    state_dir: Path,
    log_path: Path,
    *,
    port: int = 0,
    extra_args: list[str] | None = None,
) -> tuple[Process, str]:
    """Start ``python -m coordinator`` and return it with its URL once it listens.

    ``port`` 0 picks a free port; a restart passes the previous one so nodes find it again.
    The URL comes from the ``coordinator.json`` this very process announces in ``state_dir``.
    """
    address = state_dir / "coordinator.json"
    address.unlink(missing_ok=True)  # a stale file from a killed run must not be read
    args = [sys.executable, "-m", "coordinator", "--config", str(config_path), "--port", str(port)]
    proc = Process("coordinator", args + (extra_args or []), log_path, env=_quiet_env())
    deadline = time.monotonic() + COORDINATOR_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UpError(f"the coordinator exited with code {proc.poll()}:\n{proc.tail()}")
        if address.exists():
            try:
                announced = json.loads(address.read_text())
            except ValueError:
                announced = {}  # written atomically, but read defensively
            if announced.get("pid") == proc.pid and "url" in announced:
                return proc, str(announced["url"])
        time.sleep(0.1)
    proc.stop()
    raise UpError(
        f"the coordinator did not start within {COORDINATOR_START_S:.0f} s:\n{proc.tail()}"
    )


def start_node(
    name: str,
    url: str,
    token: str,
    state_dir: Path,
    log_path: Path,
    data: str | None,
    extra_env: dict[str, str] | None = None,
    limits: tuple[str | None, str | None] = (None, None),
    device: str = "cpu",
    threads: int = 1,
    ranks: int | None = None,
    torchrun: bool = False,
) -> Process:
    """A node process; with ``ranks`` one node of that many processes (``sparseloco node
    --ranks N``, or with ``torchrun`` the torchrun line the guide also gives)."""
    args = node_command(url, ranks, torchrun)
    args += ["--state-dir", str(state_dir), "--threads", str(threads), "--device", device]
    if data:
        args += ["--data", data]
    for way, limit in zip(("upload", "download"), limits, strict=True):
        if limit is not None:
            args += [f"--{way}-limit", limit]
    env = _quiet_env(threads)
    env.pop("SPARSELOCO_FAULTS", None)
    env.update(extra_env or {})
    env["SPARSELOCO_NODE_TOKEN"] = token
    return Process(name, args, log_path, env=env)


def node_command(url: str, ranks: int | None = None, torchrun: bool = False) -> list[str]:
    """The command of a node of ``url``'s run up to its state: one plain process (``ranks``
    None), ``sparseloco node --ranks N``, or with ``torchrun`` torchrun's line for N."""
    args = [sys.executable, "-m", "node", "node", "--coordinator", url]
    if ranks is not None and torchrun:
        # torchrun (the script next to this Python), N copies of the node.
        script = Path(sys.executable).with_name("torchrun")
        launch = (
            [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
        )
        args = [*launch, "--standalone", f"--nproc-per-node={ranks}", *args[1:]]
    elif ranks is not None:
        args += ["--ranks", str(ranks)]
    return args
