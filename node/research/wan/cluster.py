"""A whole local run inside the WAN lab: ``sparseloco up``, every node behind its own link.

``run_in_lab`` is ``node.cluster.up.up`` with the network replaced: the store (SeaweedFS) and
the coordinator run in the lab's server namespace, listening on every address there and named
by the service address (which is what presigned URLs carry); each node runs in a namespace of
its own behind its profile (``tc tbf`` rates, the relay's delay, jitter, window and resets,
``node.research.wan.lab``). The pieces are ``up``'s own: the run config (``run_config``), the
coordinator's config file and start, the node processes, the watch of the coordinator's status
and the summary (per round: every node's timings and bytes, the round's duration), so a lab run
and a loopback run of the same ``UpConfig`` differ in the links only.

Order of start: lab, store, coordinator (the ports the relays must forward are known only
then), then the node namespaces with their relays, then the nodes. Stop: nodes, coordinator,
store, lab (which kills whatever else still runs in its namespaces and deletes them). The
launcher's thread polls the coordinator from the server namespace, so its own polls cross no
shaped link. ``sparseloco bench wan`` runs this once per profile, size and schedule; a test of
mixed profiles passes one profile per node.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from node.cluster.launch import coordinator_toml, start_coordinator
from node.cluster.process import Process
from node.cluster.seaweed import EmbeddedStore
from node.cluster.status import summarize, watch
from node.cluster.up import UpConfig, run_config, start_run_node
from node.errors import UpError
from node.research.wan.lab import WanLab
from node.research.wan.profiles import LinkProfile
from protocol.status import StatusView

log = logging.getLogger("sparseloco.wan.cluster")

#: Every address of the server namespace: relays reach it by its bridge address, the server's
#: own processes by the service address.
ANY_ADDRESS = "0.0.0.0"
#: The lab's addresses are private to this machine: plain HTTP to the service address is what
#: a node on a trusted private network is allowed with ``--allow-insecure-http``.
LAB_ENV = {"SPARSELOCO_NODE_ALLOW_INSECURE_HTTP": "1"}


def run_in_lab(
    cfg: UpConfig,
    profiles: Sequence[LinkProfile],
    *,
    run_overrides: dict[str, Any] | None = None,
    on_status: Callable[[StatusView], None] | None = None,
    node_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` in a new lab, node ``i`` behind ``profiles[i % len(profiles)]``; ``up``'s
    summary plus ``profiles`` (node → profile name), ``resets`` (node → connections its relay
    reset), ``relays_alive`` (every relay still ran at the end) and ``coordinator_exit`` (its
    code after SIGTERM); every process's log is in ``run_dir/logs``, every relay's in
    ``run_dir/lab``. ``cfg.data`` must be text or None (the bundled corpus): every node reads
    it locally, as a prepared dataset would have to be uploaded first."""
    if not profiles:
        raise UpError("run_in_lab needs at least one link profile")
    if cfg.data is not None and (Path(cfg.data) / "manifest.json").exists():
        raise UpError("the WAN lab runs on text data or the bundled corpus, not a prepared one")
    run_dir = cfg.run_dir or Path("runs") / time.strftime("wan-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    run = run_config(cfg, None, run_overrides)
    tokens = {f"node-{i}": secrets.token_urlsafe(18) for i in range(cfg.nodes)}
    links = {name: profiles[i % len(profiles)] for i, name in enumerate(tokens)}
    procs: list[Process] = []
    t0 = time.monotonic()
    with WanLab(root=run_dir / "lab") as lab:
        store = EmbeddedStore(run_dir / "store", host=lab.service_ip, bind=ANY_ADDRESS)
        try:
            with lab.entered():
                endpoint = store.start()
                config_path = run_dir / "coordinator.toml"
                state = run_dir / "coordinator"
                state.mkdir(exist_ok=True)
                config_path.write_text(
                    coordinator_toml(run, endpoint, tokens, state, server={"host": ANY_ADDRESS}),
                    encoding="utf-8",
                )
                coordinator, announced = start_coordinator(
                    config_path, state, run_dir / "logs" / "coordinator.log"
                )
            procs.append(coordinator)
            port = urlparse(announced).port
            if port is None or store.s3_port is None:
                raise UpError(f"no port in the coordinator's address {announced!r}")
            url = f"http://{lab.service_ip}:{port}"
            lab.expose(store.s3_port, port)
            log.info("event=wan_started run_dir=%s coordinator=%s", run_dir, url)
            nodes = []
            env = {**LAB_ENV, **(node_env or {})}
            for i, (name, token) in enumerate(tokens.items()):
                host = lab.add_node(name, links[name], seed=i)
                with host.entered():
                    nodes.append(start_run_node(cfg, run_dir, i, name, token, url, extra_env=env))
            procs += nodes
            with lab.entered():
                status = watch(url, nodes, on_status)
            for node in nodes:
                code = node.stop()
                if code != 0:
                    raise UpError(f"{node.name} exited with code {code}:\n{node.tail()}")
            relays = {name: host.relay for name, host in lab.hosts.items()}
            result = summarize(status)
            result["relays_alive"] = all(
                r is not None and r.poll() is None for r in relays.values()
            )
            result["coordinator_exit"] = coordinator.stop()
            result["wall_seconds"] = time.monotonic() - t0
            result["run_dir"] = str(run_dir)
            result["nodes"] = cfg.nodes
            result["profiles"] = {name: p.name for name, p in links.items()}
            result["resets"] = {name: lab.resets(name) for name in tokens}
            return result
        finally:
            for proc in reversed(procs):
                proc.stop()
            store.stop()
