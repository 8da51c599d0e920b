"""``sparseloco doctor``: can this machine take part in that run? Every check says how to fix it.

Checks, in order (each ``ok``, ``warn`` or ``FAIL``; any FAIL makes the exit status 1):

- coordinator: ``GET /v1/status`` answers, and which run, round and state it reports;
- clock: the coordinator's ``Date`` header against this machine's clock (presigned URLs carry
  their expiry; a clock far off makes stores refuse them);
- token: the coordinator accepts it (``GET /v1/round``), and whether it is a member already;
- state: a ``--state-dir`` that holds state of another run is refused by the node; said here;
- store: a presigned PUT and GET of a probe object through the run's store (``POST /v1/probe``),
  digest checked, with the upload and download rates;
- disk and memory: free space in the state dir and available memory against what the run's
  model needs (θ, error buffer, AdamW moments, the pending round, an atomic save's copy);
- threads and GPU: CPU cores this process may use; whether torch sees a CUDA device.

Nothing here joins the run or changes anything on the coordinator but the probe object.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from node.daemon.client import CoordinatorClient
from node.daemon.retry import RetryPolicy
from node.daemon.tls import CERTIFICATE_FIX, certificate_reason, connector
from node.daemon.transfer import HttpTransfers, TransferTimeouts
from node.errors import CoordinatorError, RetriesExhausted, TransferError
from protocol.errors import SparseLoCoError
from protocol.messages import StatusView

#: Fail fast: a doctor that hangs on a dead coordinator helps nobody.
DOCTOR_POLICY = RetryPolicy(attempts=3, base_s=0.5, max_delay_s=2.0, budget_s=15.0)
#: Bytes moved by the store probe (enough to see a rate, small enough for a slow link).
PROBE_BYTES = 4 << 20
#: Clock skew (seconds) worth a warning, and one that fails.
SKEW_WARN_S, SKEW_FAIL_S = 30.0, 300.0
#: fp32 copies of the model a node holds: θ, error buffer, two AdamW moments, θ_r during
#: training, ĉ, gradients, and the state file's atomic copy on disk.
MEMORY_COPIES = 7
DISK_COPIES = 10


@dataclass(frozen=True)
class Check:
    name: str
    level: str  # "ok", "warn" or "FAIL"
    detail: str
    fix: str = ""


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


class Doctor:
    """Runs the checks against one coordinator, as one token holder."""

    def __init__(
        self,
        coordinator: str,
        token: str | None,
        state_dir: Path | None,
        *,
        ca_cert: Path | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.token = token
        self.state_dir = state_dir
        self.ca_cert = ca_cert
        self.checks: list[Check] = []
        self.status: StatusView | None = None

    def add(self, name: str, level: str, detail: str, fix: str = "") -> None:
        self.checks.append(Check(name, level, detail, fix))

    @property
    def failed(self) -> bool:
        return any(c.level == "FAIL" for c in self.checks)

    async def run(self) -> list[Check]:
        async with aiohttp.ClientSession(connector=connector(self.ca_cert)) as http:
            api = CoordinatorClient(http, self.coordinator, self.token or "-", policy=DOCTOR_POLICY)
            await self._coordinator(http, api)
            if self.status is not None:
                await self._token(api, http)
        self._state()
        self._machine()
        return self.checks

    async def _coordinator(self, http: aiohttp.ClientSession, api: CoordinatorClient) -> None:
        url = f"{self.coordinator}/v1/status?rounds=1"
        try:
            timeout = aiohttp.ClientTimeout(total=15)
            async with http.get(url, timeout=timeout) as resp:
                raw = await resp.read()
                date = resp.headers.get("Date")
                if resp.status != 200:
                    raise TransferError(f"HTTP {resp.status}", resp.status)
            self.status = StatusView.model_validate_json(raw)
        except aiohttp.ClientConnectorCertificateError as exc:
            reason = certificate_reason(exc)
            self.add(
                "coordinator", "FAIL", f"TLS certificate not trusted ({reason})", CERTIFICATE_FIX
            )
            return
        except (aiohttp.ClientError, TimeoutError, TransferError, ValueError) as exc:
            self.add(
                "coordinator",
                "FAIL",
                f"{self.coordinator} did not answer: {exc}",
                "check the URL (scheme, host, port), that the coordinator runs, and that this"
                " machine may reach it (firewall, proxy)",
            )
            return
        s = self.status
        self.add(
            "coordinator",
            "ok",
            f"run {s.run_id}: round {s.round} of {s.run.rounds}, {s.state.value},"
            f" model {s.run.model}, {sum(m.state.value == 'active' for m in s.members)} active",
        )
        if date:
            theirs = email.utils.parsedate_to_datetime(date).timestamp()
            skew = time.time() - theirs
            level = (
                "ok" if abs(skew) < SKEW_WARN_S else "warn" if abs(skew) < SKEW_FAIL_S else "FAIL"
            )
            self.add(
                "clock",
                level,
                f"this machine is {skew:+.0f} s from the coordinator",
                "" if level == "ok" else "synchronise the clock (e.g. systemd-timesyncd, chrony)",
            )

    async def _token(self, api: CoordinatorClient, http: aiohttp.ClientSession) -> None:
        if not self.token:
            self.add("token", "warn", "no token given", "pass --token or set SPARSELOCO_NODE_TOKEN")
            return
        try:
            view = await api.round()
        except CoordinatorError as exc:
            fix = "ask the run's operator for a valid token (sparseloco coordinator token add)"
            self.add("token", "FAIL", f"refused: {exc.error}", fix)
            return
        except (RetriesExhausted, SparseLoCoError) as exc:
            self.add("token", "FAIL", f"could not ask: {exc}", "see the coordinator check")
            return
        member = "expected in this round" if view.expected else "accepted"
        self.add("token", "ok", f"{member}; round {view.round} is {view.state.value}")
        await self._store(api, http)
        if self.status is not None and self.status.run.dataset is not None:
            await self._dataset(api, http, self.status.run.dataset)

    async def _dataset(
        self, api: CoordinatorClient, http: aiohttp.ClientSession, dataset: str
    ) -> None:
        """The run's dataset: its manifest reachable through the store, the one the run names,
        and its vocabulary inside the model's."""
        from node.compute.data import check_vocabulary
        from node.compute.model import get_preset
        from protocol.dataset import dataset_hex, parse_manifest

        transfers = HttpTransfers(http, TransferTimeouts(connect_s=10, transfer_s=120))
        try:
            view = await api.dataset()
            data = await transfers.get(
                view.manifest_url, size=view.manifest_size, sha256=dataset_hex(dataset)
            )
            manifest = parse_manifest(data, dataset)
            assert self.status is not None
            check_vocabulary(manifest, get_preset(self.status.run.model).vocab_size, where=dataset)
        except (
            CoordinatorError,
            TransferError,
            RetriesExhausted,
            SparseLoCoError,
            ValueError,
        ) as exc:
            fix = "the run's operator must upload it: sparseloco data prepare ... --upload"
            self.add("dataset", "FAIL", f"the run's dataset is not usable: {exc}", fix)
            return
        per_shard = max(manifest.files().values())
        self.add(
            "dataset",
            "ok",
            f"{dataset[:19]}...: {manifest.total_tokens:,} {manifest.tokenizer.kind} tokens in"
            f" {len(manifest.shards)} shards; this node keeps a few of them on disk"
            f" (up to {_bytes(per_shard)} each)",
        )

    async def _store(self, api: CoordinatorClient, http: aiohttp.ClientSession) -> None:
        data = os.urandom(PROBE_BYTES)
        sha = hashlib.sha256(data).hexdigest()
        try:
            probe = await api.probe(len(data), sha)
        except CoordinatorError as exc:
            self.add("store", "warn", f"the coordinator offers no probe ({exc.error})")
            return
        transfers = HttpTransfers(http, TransferTimeouts(connect_s=10, transfer_s=120))
        try:
            t0 = time.perf_counter()
            await transfers.put(probe.put_url, probe.put_headers, data)
            t1 = time.perf_counter()
            back = await transfers.get(probe.get_url, size=len(data), sha256=sha)
            t2 = time.perf_counter()
        except (TransferError, RetriesExhausted) as exc:
            self.add(
                "store",
                "FAIL",
                f"presigned transfer failed: {exc}",
                "this machine must reach the store's endpoint over HTTP(S); ask the operator"
                " which address the store is published on",
            )
            return
        assert back == data  # get() verified size and sha256 already
        up, down = len(data) / (t1 - t0), len(data) / (t2 - t1)
        self.add(
            "store",
            "ok",
            f"presigned PUT and GET of {_bytes(len(data))}: up {_bytes(up)}/s, down"
            f" {_bytes(down)}/s",
        )

    def _state(self) -> None:
        d = self.state_dir
        if d is None:
            return
        if not (d / "state.safetensors").exists():
            self.add(
                "state",
                "ok",
                f"{d}: no state yet (the node starts from the run's newest checkpoint)",
            )
            return
        import json

        from safetensors import safe_open

        try:
            with safe_open(str(d / "state.safetensors"), framework="pt") as f:
                header = json.loads((f.metadata() or {})["sparseloco"])
        except Exception as exc:  # a damaged file: the node sets it aside
            self.add("state", "warn", f"{d}: unreadable state ({exc}); the node will set it aside")
            return
        run_id = self.status.run_id if self.status else None
        if run_id is not None and header.get("run_id") != run_id:
            self.add(
                "state",
                "FAIL",
                f"{d} holds run {header.get('run_id')}, the coordinator runs {run_id}",
                "use another --state-dir for this run",
            )
        else:
            self.add("state", "ok", f"{d}: {header.get('node_id')} at round {header.get('round')}")

    def _machine(self) -> None:
        need = None
        if self.status is not None:
            from node.compute.model import get_preset, param_count

            need = 4 * param_count(get_preset(self.status.run.model))
        where = self.state_dir or Path.cwd()
        probe_dir = where if where.exists() else where.parent
        free = shutil.disk_usage(probe_dir if probe_dir.exists() else Path.cwd()).free
        if need is not None:
            disk_need = DISK_COPIES * need
            level = _level(free >= 2 * disk_need, free >= disk_need)
            self.add(
                "disk",
                level,
                f"{_bytes(free)} free at {probe_dir}; the run's model needs about"
                f" {_bytes(disk_need)}",
                "" if level == "ok" else "free space or point --state-dir at a larger disk",
            )
            available = _mem_available()
            if available is not None:
                mem_need = MEMORY_COPIES * need
                level = (
                    "ok"
                    if available >= 2 * mem_need
                    else "warn"
                    if available >= mem_need
                    else "FAIL"
                )
                self.add(
                    "memory",
                    level,
                    f"{_bytes(available)} available; the run's model needs about"
                    f" {_bytes(mem_need)}",
                    "" if level == "ok" else "close other programs or use a larger machine",
                )
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self.add(
            "threads",
            "ok",
            f"{cores} CPU cores for this process",
            "several nodes on one machine: give each --threads (cores / nodes)",
        )
        import torch

        gpu = torch.cuda.is_available()
        detail = (
            f"CUDA: {torch.cuda.get_device_name(0)}" if gpu else "no CUDA device: trains on CPU"
        )
        self.add("gpu", "ok", detail)


def _level(fine: bool, tolerable: bool) -> str:
    return "ok" if fine else "warn" if tolerable else "FAIL"


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def report(checks: list[Check], write: Callable[[str], None] = print) -> None:
    width = max(len(c.name) for c in checks)
    for c in checks:
        write(f"{c.level:>4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.level != "ok":
            write(f"      {'':<{width}}  fix: {c.fix}")


def doctor(
    coordinator: str, token: str | None, state_dir: Path | None, *, ca_cert: Path | None = None
) -> int:
    """Run every check, print them; 1 if any failed, else 0 (``ca_cert``: an extra CA file)."""
    d = Doctor(coordinator.rstrip("/"), token, state_dir, ca_cert=ca_cert)
    checks = asyncio.run(d.run())
    report(checks)
    failed = [c.name for c in checks if c.level == "FAIL"]
    print("all checks passed" if not failed else f"failed: {', '.join(failed)}")
    return 1 if failed else 0
