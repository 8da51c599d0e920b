"""``sparseloco up``: a whole networked run on this machine, from one command, offline.

Starts, in order, the embedded object store (SeaweedFS ``weed mini``), a coordinator process
and N node processes, each a real process talking HTTP on loopback exactly as on the internet;
trains on the bundled demo corpus (or ``--data``: text each node reads, or a folder made by
``sparseloco data prepare``, which is uploaded to the store and streamed from there by the
nodes, a shard at a time); shows live progress from the coordinator's status endpoint;
and stops everything again in reverse order, on success, on error and on Ctrl-C. Everything
(store data, coordinator database, node states, logs) lands in one run folder, and with it
the final model (``final/``: θ after the last round, the agreed fingerprint and the run
config, ``node.tools.offline``), which ``sparseloco export --run`` exports with nothing running.

The result (``--json``, ``node.cluster.status.summarize``) has ``run_id``, ``final_eval_loss``
and per round the gather set, exclusions and every node's reported fingerprint, plus whether
they all agreed. A round's ``eval_loss`` is None where the run's evaluation schedule
(``RunConfig.eval_every``) skipped it. The processes are started by ``node.cluster.launch``.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from node.cluster.launch import coordinator_toml, start_coordinator, start_node
from node.cluster.process import Process
from node.cluster.seaweed import EmbeddedStore
from node.cluster.status import summarize, watch
from node.compute.data import check_vocabulary
from node.compute.model import get_preset
from node.compute.presets import get_run_preset
from node.daemon.ratelimit import parse_rate
from node.daemon.settings import check_device_spec
from node.errors import DataError, UpError
from node.tools.offline import keep_agreed
from node.tools.shards import upload
from protocol.bounds import Count, Positive
from protocol.dataset import MANIFEST_FILE, DatasetManifest, parse_manifest
from protocol.runconfig import RunConfig, Timing
from protocol.status import StatusView

log = logging.getLogger("sparseloco.up")


class UpConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: int = Field(3, ge=1, le=32)
    rounds: Count = 5
    preset: str = "tiny"
    run_dir: Path | None = None
    data: str | None = None
    #: Seconds a round may run before it closes without missing nodes.
    round_timeout_s: Positive = 120.0
    #: Evaluate every this many rounds (and the first and last); None: the run config's default.
    eval_every: Count | None = None
    #: The run's ``overlap`` (off, delayed, eager, merge); None: the run config's default (off).
    overlap: Literal["off", "delayed", "eager", "merge"] | None = None
    #: (merge) The run's ``overlap_tau``; None: its default.
    overlap_tau: Count | None = None
    #: (merge) The run's ``overlap_rows``; None: its default.
    overlap_rows: Count | None = None
    #: Every node's upload and download caps (``--upload-limit``, ``--download-limit``).
    upload_limit: str | None = None
    download_limit: str | None = None
    #: Where each node's inner steps run: one device for all (auto, cpu, cuda:N), or a
    #: comma-separated list the nodes take in turn (``cuda:0,cuda:0,cpu``).
    device: str = "cpu"
    #: torch (and numba) threads per node.
    threads: Count = 1
    #: Processes per node (``sparseloco node --ranks``): one count for all, or a comma-separated
    #: list the nodes take in turn (``1,2,4``). A node of N processes shards its state over
    #: them; one of 1 keeps it on its device. None: plain processes (θ on the CPU).
    ranks: str | None = None

    @field_validator("device")
    @classmethod
    def _devices(cls, value: str) -> str:
        return ",".join(check_device_spec(spec.strip()) for spec in value.split(","))

    def node_device(self, i: int) -> str:
        """The device of node ``i``."""
        return self.device.split(",")[i % (self.device.count(",") + 1)]

    @field_validator("ranks")
    @classmethod
    def _ranks(cls, value: str | None) -> str | None:
        if value is None:
            return None
        counts = [c.strip() for c in value.split(",")]
        if not all(c.isdigit() and 1 <= int(c) <= 64 for c in counts):
            raise ValueError(f"{value!r}: give process counts of 1 to 64, e.g. 2 or 1,2,4")
        return ",".join(str(int(c)) for c in counts)

    def node_ranks(self, i: int) -> int | None:
        """How many processes node ``i`` runs under ``--ranks``; None: one plain process."""
        if self.ranks is None:
            return None
        counts = self.ranks.split(",")
        return int(counts[i % len(counts)])

    @field_validator("upload_limit", "download_limit")
    @classmethod
    def _rate(cls, value: str | None) -> str | None:
        if value is not None:
            parse_rate(value)  # ConfigError is a ValueError: refused before anything starts
        return value


def run_config(
    cfg: UpConfig,
    dataset: DatasetManifest | None = None,
    run_overrides: dict[str, Any] | None = None,
) -> RunConfig:
    """The run a local run of ``cfg`` starts: its preset's shape, every node a member of the
    gather set, deadlines from ``round_timeout_s``; ``run_overrides`` replace values."""
    run = RunConfig(
        dataset=None if dataset is None else dataset.dataset_id,
        name="up",
        rounds=cfg.rounds,
        min_nodes=cfg.nodes,
        gather_size=max(16, cfg.nodes),
        timing=Timing(
            first_round_s=cfg.round_timeout_s,
            min_round_s=min(15.0, cfg.round_timeout_s),
            max_round_s=max(cfg.round_timeout_s, 15.0),
            heartbeat_timeout_s=30.0,
        ),
        **get_run_preset(cfg.preset).shape(),
        **({} if cfg.eval_every is None else {"eval_every": cfg.eval_every}),
        **({} if cfg.overlap is None else {"overlap": cfg.overlap}),
        **({} if cfg.overlap_tau is None else {"overlap_tau": cfg.overlap_tau}),
        **({} if cfg.overlap_rows is None else {"overlap_rows": cfg.overlap_rows}),
    )
    if run_overrides:
        run = RunConfig.model_validate({**run.model_dump(), **run_overrides})
    return run


def up(
    cfg: UpConfig,
    on_status: Callable[[StatusView], None] | None = None,
    *,
    run_overrides: dict[str, Any] | None = None,
    node_env: dict[str, str] | None = None,
    node_threads: list[int] | None = None,
    node_envs: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """Run the whole local run; its summary. ``run_overrides`` replace run config values,
    ``node_env`` adds to every node's environment and ``node_envs[i]`` to node i's,
    ``node_threads[i]`` is node i's threads."""
    dataset = prepared_dataset(cfg.data, get_run_preset(cfg.preset).model)
    run_dir = cfg.run_dir or Path("runs") / time.strftime("up-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    run = run_config(cfg, dataset, run_overrides)
    store = EmbeddedStore(run_dir / "store")
    procs: list[Process] = []
    t0 = time.monotonic()
    try:
        endpoint = store.start()
        if dataset is not None and cfg.data is not None:
            # The nodes stream their shards from the store, as they would over the internet.
            upload(
                Path(cfg.data),
                dataset,
                endpoint=endpoint.endpoint_url,
                bucket=endpoint.bucket,
                prefix="",
                credentials=(endpoint.access_key, endpoint.secret_key),
            )
            log.info("event=dataset_uploaded dataset=%s", dataset.dataset_id)
        tokens = {f"node-{i}": secrets.token_urlsafe(18) for i in range(cfg.nodes)}
        config_path = run_dir / "coordinator.toml"
        config_path.write_text(
            coordinator_toml(run, endpoint, tokens, run_dir / "coordinator"), encoding="utf-8"
        )
        (run_dir / "coordinator").mkdir(exist_ok=True)
        coordinator, url = start_coordinator(
            config_path, run_dir / "coordinator", run_dir / "logs" / "coordinator.log"
        )
        procs.append(coordinator)
        log.info(
            "event=up_started run_dir=%s coordinator=%s store=%s",
            run_dir,
            url,
            endpoint.endpoint_url,
        )
        nodes = [
            start_run_node(
                cfg,
                run_dir,
                i,
                name,
                token,
                url,
                streamed=dataset is not None,
                extra_env={**(node_env or {}), **(node_envs[i] if node_envs else {})},
                threads=node_threads[i] if node_threads else None,
                ranks=cfg.node_ranks(i),
            )
            for i, (name, token) in enumerate(tokens.items())
        ]
        procs += nodes
        status = watch(url, nodes, on_status)
        for node in nodes:
            code = node.stop()
            if code != 0:
                raise UpError(f"{node.name} exited with code {code}:\n{node.tail()}")
        result = summarize(status)
        node_dirs = [run_dir / "nodes" / name for name in tokens]
        result["final_model"] = keep_agreed(run_dir, run, status, node_dirs, cfg.data)
        result["wall_seconds"] = time.monotonic() - t0
        result["run_dir"] = str(run_dir)
        result["nodes"] = cfg.nodes
        return result
    finally:
        for proc in reversed(procs):
            proc.stop()
        store.stop()


def process_age_s() -> float | None:
    """Seconds since this process started (its interpreter's start included: what a user
    timing the command sees), from ``/proc``; None where there is no ``/proc``."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(after_name[19])  # field 22, starttime, in clock ticks after boot
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def start_run_node(
    cfg: UpConfig,
    run_dir: Path,
    i: int,
    name: str,
    token: str,
    url: str,
    *,
    streamed: bool = False,
    extra_env: dict[str, str] | None = None,
    threads: int | None = None,
    ranks: int | None = None,
) -> Process:
    """Node ``i`` of a local run of ``cfg``: its state in ``run_dir/nodes/NAME``, its log in
    ``run_dir/logs/NAME.log``, ``cfg.data`` to read unless the run ``streamed`` a prepared
    dataset from the store, the run's transfer caps, node ``i``'s device, ``threads`` (by
    default ``cfg.threads``) and ``ranks`` processes (None: one plain process)."""
    return start_node(
        name, url, token, run_dir / "nodes" / name, run_dir / "logs" / f"{name}.log",
        None if streamed else cfg.data,
        extra_env=extra_env, limits=(cfg.upload_limit, cfg.download_limit),
        device=cfg.node_device(i), threads=cfg.threads if threads is None else threads,
        ranks=ranks,
    )  # fmt: skip


def prepared_dataset(data: str | None, model: str) -> DatasetManifest | None:
    """The manifest of ``data`` when it is a folder made by ``sparseloco data prepare`` (the
    run then names it, and the nodes stream it from the store), checked against ``model``'s
    vocabulary; None for text (each node reads it locally)."""
    if data is None or not (Path(data) / MANIFEST_FILE).is_file():
        return None
    path = Path(data) / MANIFEST_FILE
    try:
        manifest = parse_manifest(path.read_bytes())
    except ValueError as exc:
        raise UpError(f"{path} is not a dataset manifest: {exc}") from exc
    try:
        check_vocabulary(manifest, get_preset(model).vocab_size, where=data)
    except DataError as exc:
        raise UpError(f"{exc}; e.g. --preset llama_bpe") from exc
    return manifest
