"""``sparseloco doctor``: can this machine take part in that run? Every check says how to fix it.

Checks, in order (each ``ok``, ``warn``, ``FAIL``, or ``--`` when an earlier failure leaves
nothing to check it with; the whole list is printed every time, any FAIL makes the exit status
1, and each FAIL says what it can tell of the cause and the fix):

- coordinator: ``GET /v1/status`` answers, and which run, round and state it reports;
- clock: the coordinator's ``Date`` header against this machine's clock (presigned URLs carry
  their expiry; a clock far off makes stores refuse them);
- token: the coordinator accepts it (``GET /v1/round``), and whether it is a member already;
- state: a ``--state-dir`` that holds state of another run is refused by the node; said here;
- store: a presigned PUT and GET of a probe object through the run's store (``POST /v1/probe``),
  digest checked, with the upload and download rates; a coordinator that answers while its
  store does not (503 ``storage_unavailable``) is told apart from a store this machine cannot
  reach;
- link: whether that upload rate gets the run's payload in within a round's time budget, as the
  node will plan it (``node.compute.linkbudget``): all of it, fewer entries per tile, or none
  (a warning: the node will only observe, applying every round);
- disk and memory: free space in the state dir and available memory against what the run's
  model needs (θ, error buffer, AdamW moments, the pending round, an atomic save's copy);
- threads and GPU: CPU cores this process may use; whether torch sees a CUDA device (these
  and the state dir in ``node.tools.checks``: they need no network).

Nothing here joins the run or changes anything on the coordinator but the probe object. Causes
are said in a few words (``protocol.causes``), never as an exception's repr; the retries' own
outage lines are silenced, the checklist says it.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

import aiohttp

from node.daemon.client import CoordinatorClient
from node.daemon.retry import RetryPolicy
from node.daemon.tls import CERTIFICATE_FIX, certificate_reason, connector
from node.daemon.transfer import HttpTransfers
from node.daemon.transferopts import TransferTimeouts
from node.errors import CoordinatorError, RetriesExhausted, TransferError
from node.tools.checks import SKIPPED, Check, human_bytes, machine_checks, state_check
from protocol.causes import cause
from protocol.errors import SparseLoCoError
from protocol.messages import RoundView
from protocol.status import StatusView

#: Fail fast: a doctor that hangs on a dead coordinator helps nobody.
DOCTOR_POLICY = RetryPolicy(attempts=3, base_s=0.5, max_delay_s=2.0, budget_s=15.0)
#: Bytes moved by the store probe (enough to see a rate, small enough for a slow link).
PROBE_BYTES = 4 << 20
#: Clock skew (seconds) worth a warning, and one that fails.
SKEW_WARN_S, SKEW_FAIL_S = 30.0, 300.0
#: Errors a network check meets; each becomes that check's FAIL line with its cause.
NETWORK_ERRORS = (SparseLoCoError, aiohttp.ClientError, TimeoutError, OSError)

FIX_COORDINATOR = (
    "check the URL (scheme, host, port), that the coordinator runs, and that this machine may"
    " reach it (firewall, proxy)"
)
FIX_TOKEN = "ask the run's operator for a valid token (sparseloco coordinator token add)"
FIX_STORE_BEHIND = (
    "nothing to change on this machine: the run's operator must start or fix the object store"
    " (sparseloco store, or [storage] in the coordinator's config); then run doctor again"
)
FIX_STORE_REACH = (
    "this machine must reach the store's endpoint over HTTP(S); ask the operator which address"
    " the store is published on"
)


@dataclass(eq=False)
class Doctor:
    """Runs the checks against one coordinator, as one token holder (``ca_cert``: an extra CA
    file to trust)."""

    coordinator: str
    token: str | None
    state_dir: Path | None
    _: KW_ONLY
    ca_cert: Path | None = None
    checks: list[Check] = field(default_factory=list, init=False)
    #: The coordinator's status, once it answered.
    status: StatusView | None = field(default=None, init=False)
    #: The round as this token sees it, once the coordinator accepted the token.
    view: RoundView | None = field(default=None, init=False)

    def add(self, name: str, level: str, detail: str, fix: str = "") -> None:
        self.checks.append(Check(name, level, detail, fix))

    def skip(self, why: str, *names: str) -> None:
        """Checks that cannot run (``why``: what they would need)."""
        for name in names:
            self.add(name, SKIPPED, f"not checked: {why}")

    async def guarded(self, name: str, check: Awaitable[None], fix: str) -> bool:
        """Run ``check``; an error it did not expect is its FAIL line, with the cause. True if
        it added no FAIL."""
        before = len(self.checks)
        try:
            await check
        except NETWORK_ERRORS as exc:
            self.add(name, "FAIL", f"could not check: {cause(exc)}", fix)
        return not any(c.level == "FAIL" for c in self.checks[before:])

    @property
    def failed(self) -> bool:
        return any(c.level == "FAIL" for c in self.checks)

    async def run(self) -> list[Check]:
        with _quiet_retries():
            async with aiohttp.ClientSession(connector=connector(self.ca_cert)) as http:
                api = CoordinatorClient(
                    http, self.coordinator, self.token or "-", policy=DOCTOR_POLICY
                )
                await self.guarded("coordinator", self._coordinator(http), FIX_COORDINATOR)
                if self.status is None:
                    self.skip("the coordinator did not answer", "clock", "token", "store")
                else:
                    await self._token(api, http)
        self._state()
        self._machine()
        return self.checks

    async def _coordinator(self, http: aiohttp.ClientSession) -> None:
        url = f"{self.coordinator}/v1/status?rounds=1"
        try:
            timeout = aiohttp.ClientTimeout(total=15)
            async with http.get(url, timeout=timeout) as resp:
                raw = await resp.read()
                date = resp.headers.get("Date")
                server = resp.headers.get("Server", "")
                status = resp.status
            if status != 200:
                # It answered, with something that is not a coordinator's status (the store's
                # port given by mistake answers 403; a web server, 404).
                what = f"HTTP {status}" + (f" from {server!r}" if server else "")
                self.add(
                    "coordinator", "FAIL",
                    f"{self.coordinator} answered {what}, not as a sparseloco coordinator",
                    FIX_COORDINATOR,
                )  # fmt: skip
                return
            self.status = StatusView.model_validate_json(raw)
        except aiohttp.ClientConnectorCertificateError as exc:
            reason = certificate_reason(exc)
            self.add(
                "coordinator", "FAIL", f"TLS certificate not trusted ({reason})", CERTIFICATE_FIX
            )
            return
        except (aiohttp.ClientError, TimeoutError, TransferError) as exc:
            self.add(
                "coordinator", "FAIL", f"{self.coordinator} did not answer: {cause(exc)}",
                FIX_COORDINATOR,
            )  # fmt: skip
            return
        except ValueError:
            self.add(
                "coordinator", "FAIL",
                f"{self.coordinator} answered, but not as a sparseloco coordinator",
                FIX_COORDINATOR,
            )  # fmt: skip
            return
        s = self.status
        self.add(
            "coordinator",
            "ok",
            f"run {s.run_id}: "
            + (
                f"all {s.run.rounds} rounds done"
                if s.state.value == "finished"
                else f"round {s.round} of {s.run.rounds} (from 0)"
            )
            + f", {s.state.value},"
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
        dataset = self.status.run.dataset if self.status is not None else None
        later = ("store", "dataset") if dataset is not None else ("store",)
        if not self.token:
            self.add("token", "warn", "no token given", "pass --token or set SPARSELOCO_NODE_TOKEN")
            self.skip("it needs a token", *later)
            return
        try:
            view = await api.round()
        except CoordinatorError as exc:
            why = "revoked" if exc.error == "token_revoked" else "not a token of this run"
            detail = f"the coordinator refused it ({why}: {exc.status} {exc.error})"
            self.add("token", "FAIL", detail, FIX_TOKEN)
            self.skip("it needs a token the coordinator accepts", *later)
            return
        except NETWORK_ERRORS as exc:
            self.add("token", "FAIL", f"could not ask: {cause(exc)}", FIX_COORDINATOR)
            self.skip("the coordinator did not answer", *later)
            return
        self.view = view
        member = "expected in this round" if view.expected else "accepted"
        self.add("token", "ok", f"{member}; round {view.round} is {view.state.value}")
        if not await self.guarded("store", self._store(api, http), FIX_STORE_REACH):
            if dataset is not None:
                self.skip("the store did not answer", "dataset")
            return
        if dataset is not None:
            fix = "the run's operator must upload it: sparseloco data prepare ... --upload"
            await self.guarded("dataset", self._dataset(api, http, dataset), fix)

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
            self.add("dataset", "FAIL", f"the run's dataset is not usable: {cause(exc)}", fix)
            return
        per_shard = max(manifest.files().values())
        self.add(
            "dataset",
            "ok",
            f"{dataset[:19]}...: {manifest.total_tokens:,} {manifest.tokenizer.kind} tokens in"
            f" {len(manifest.shards)} shards; this node keeps a few of them on disk"
            f" (up to {human_bytes(per_shard)} each)",
        )

    async def _store(self, api: CoordinatorClient, http: aiohttp.ClientSession) -> None:
        data = os.urandom(PROBE_BYTES)
        sha = hashlib.sha256(data).hexdigest()
        try:
            probe = await api.probe(len(data), sha)
        except CoordinatorError as exc:
            self.add("store", "warn", f"the coordinator offers no probe ({exc.error})")
            return
        except RetriesExhausted as exc:
            behind = getattr(exc.__cause__, "error", None) == "storage_unavailable"
            if behind:  # the coordinator answers; the store it asked did not
                detail = f"the coordinator answers, but its object store does not ({cause(exc)})"
                self.add("store", "FAIL", detail, FIX_STORE_BEHIND)
            else:
                detail = f"the coordinator did not grant a probe: {cause(exc)}"
                self.add("store", "FAIL", detail, FIX_COORDINATOR)
            return
        transfers = HttpTransfers(http, TransferTimeouts(connect_s=10, transfer_s=120))
        try:
            t0 = time.perf_counter()
            await transfers.put(probe.put_url, probe.put_headers, data)
            t1 = time.perf_counter()
            back = await transfers.get(probe.get_url, size=len(data), sha256=sha)
            t2 = time.perf_counter()
        except (TransferError, RetriesExhausted) as exc:
            self.add("store", "FAIL", f"presigned transfer failed: {cause(exc)}", FIX_STORE_REACH)
            return
        assert back == data  # get() verified size and sha256 already
        up, down = len(data) / (t1 - t0), len(data) / (t2 - t1)
        self.add(
            "store",
            "ok",
            f"presigned PUT and GET of {human_bytes(len(data))}: up {human_bytes(up)}/s, down"
            f" {human_bytes(down)}/s",
        )
        self._link(len(data), t1 - t0)

    def _link(self, probe_bytes: int, probe_up_s: float) -> None:
        """Whether this uplink gets a payload in within the round's time budget: as the node
        will plan it (``node.compute.linkbudget``), from the probe's upload."""
        from node.compute.linkbudget import LinkMeter, estimated_payload_bytes, plan
        from node.compute.model import get_preset, param_count

        assert self.status is not None
        run = self.status.run
        size = estimated_payload_bytes(param_count(get_preset(run.model)), run.topk, run.tile)
        meter = LinkMeter()
        meter.uploaded(probe_bytes, probe_up_s)
        whole = meter.upload_s(size) or 0.0
        budget = self.view.budget_s if self.view is not None else None
        if budget is None:
            budget = next((r.budget_s for r in reversed(self.status.rounds) if r.budget_s), None)
        payload = f"a payload of about {human_bytes(size)} takes {whole:.1f} s up"
        if budget is None:
            self.add("link", "ok", f"{payload}; the run's rounds have no time budget yet")
            return
        chosen = plan(budget, topk=run.topk, tile=run.tile, payload_size=size, encode_s=0.0,
                      meter=meter)  # fmt: skip
        if chosen.observing:
            self.add(
                "link", "warn",
                f"{payload}; rounds have a budget of {budget:.1f} s: not even one entry per tile"
                " gets in, so this node will apply every round and send nothing (it tries again"
                " every few rounds)",
                "a faster uplink, or a run with longer rounds (the operator's [run.timing]"
                " budget, or a larger inner_steps)",
            )  # fmt: skip
        elif chosen.cut == "link":
            self.add(
                "link", "ok",
                f"{payload}; within the round's budget of {budget:.1f} s this node sends"
                f" {chosen.topk} of the run's {run.topk} entries per tile (the rest stays in its"
                " error buffer)",
            )  # fmt: skip
        else:
            self.add("link", "ok", f"{payload}, within the round's budget of {budget:.1f} s")

    def _state(self) -> None:
        if self.state_dir is not None:
            run_id = self.status.run_id if self.status else None
            self.checks.append(state_check(self.state_dir, run_id))

    def _machine(self) -> None:
        model = self.status.run.model if self.status is not None else None
        self.checks.extend(machine_checks(model, self.state_dir))


@contextlib.contextmanager
def _quiet_retries() -> Iterator[None]:
    """The links' outage lines off while doctor runs: its checklist says what failed."""
    logger = logging.getLogger("sparseloco.link")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def report(checks: list[Check], write: Callable[[str], None] = print) -> None:
    width = max(len(c.name) for c in checks)
    for c in checks:
        write(f"{c.level:>4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.level not in ("ok", SKIPPED):
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
