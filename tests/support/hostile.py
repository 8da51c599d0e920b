"""Hostile nodes for the tests: the real daemon, wrapped at its seams, sending harmful payloads.

A hostile node is an unchanged ``NodeDaemon`` whose coordinator client and transfers
(``node.daemon.api``'s ``CoordinatorApi`` and ``Transfers``) are wrapped by ``HostileApi`` and
``HostileTransfers``. It follows the protocol in every other way (it joins, uploads, submits
with the right base fingerprint, reports) but every round replaces its honest payload with one
meant to hurt the model; the kinds are ``node.research.bench.hostile``'s (``KINDS``):

- ``sign_flip``, ``noise``, ``huge_tile``, ``one_entry``, ``replay``: the daemon trains and
  compresses honestly; when it asks for the upload grant, ``HostileApi`` encodes the hostile
  tensors (``hostile_tensors``, from the honest ĉ and error buffer its worker holds, on the
  daemon's compute thread) as a well-formed payload of the same round, node and base, asks the
  grant for those bytes, ``HostileTransfers`` PUTs them in place of the honest ones, and the
  submit and the report name them. The node's own error feedback stays honest (its ĉ is the
  honest one), so its buffer stays sane round after round while it sends something else.
  ``replay`` copies the previous round's payload of the lowest peer id, as downloaded with the
  gather set (the first round, with nothing to copy, it sends its honest payload);
- ``stale``: when the round view says the daemon is about to train, θ is set to θ of
  ``STALE_ROUNDS`` rounds ago (the oldest it has before that), so it trains from there; when
  it asks for the upload grant θ is put back, and the submit claims today's θ as the base.

The payloads pass the codec, the digests and the coordinator; what stops them is
``node.compute.robust`` on every honest node (or nothing needs to: a replay and a stale update
hurt less than leaving the node out). One process, no overlap; the node's own state dir keeps
its honest payload (and, for ``stale``, θ as it trained from it): the tests never restart it.

``python -m support.hostile_node KIND node ...`` runs one as a process
(``support.cluster.Cluster.start_node`` with ``attack=KIND`` starts it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from node.compute.heap import return_large_blocks
from node.daemon import multipart
from node.daemon.api import CoordinatorApi, Heard, Transfers
from node.daemon.loop import NodeDaemon
from node.daemon.pending import PendingRound
from node.daemon.ranks import torchrun_world
from node.daemon.serve import http_seams
from node.daemon.settings import NodeSettings
from node.research.bench.hostile import KINDS, STALE_ROUNDS, hostile_tensors
from protocol.codec import decode, encode
from protocol.dataset import DatasetFiles, DatasetView
from protocol.errors import ConfigError
from protocol.messages import (
    CheckpointInfo,
    CheckpointUpload,
    CheckpointView,
    JoinResponse,
    ManifestView,
    NodeCondition,
    RoundState,
    RoundView,
    SubmitRequest,
    SubmitResponse,
    UploadGrant,
)
from protocol.parts import CompletedPart, MultipartGrant, PartPlan, UploadComplete, UploadDone
from protocol.reports import RoundReport

Theta = dict[str, torch.Tensor]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Hostile:
    """One hostile node's plan and memory, shared by its two wrappers."""

    def __init__(self, kind: str, seed: int = 0) -> None:
        if kind not in KINDS:
            raise ConfigError(f"hostile node {kind!r}: use one of {', '.join(KINDS)}")
        self.kind = kind
        self.seed = seed
        #: The daemon wrapped (set once it is built).
        self.daemon: NodeDaemon | None = None
        #: The hostile payload sent in place of an honest one, by the honest one's sha256.
        self.swaps: dict[str, bytes] = {}
        #: The size of the hostile payload of each round that sent one (its report says so).
        self.sizes: dict[int, int] = {}
        #: ``replay``: the payloads downloaded with recent gather sets, by round and node id.
        self.gathered: dict[int, dict[str, bytes]] = {}
        #: ``replay``: the presigned GETs of recent manifests: (round, node id) by URL.
        self.urls: dict[str, tuple[int, str]] = {}
        #: ``stale``: θ at the start of recent rounds, oldest first.
        self.history: list[Theta] = []
        #: ``stale``: today's θ and its fingerprint while the daemon holds an old θ.
        self.today: tuple[Theta, str] | None = None
        #: ``stale``: the base fingerprint each round's submit claims.
        self.claims: dict[int, str] = {}

    @property
    def node(self) -> NodeDaemon:
        if self.daemon is None:
            raise RuntimeError("the hostile node's daemon is not built yet")
        return self.daemon

    def _check(self) -> None:
        if self.node.worker.run.overlaps:
            raise ConfigError("a hostile test node runs without overlap")

    # -- stale: train from an old θ ----------------------------------------------------------------

    async def before_round(self, view: RoundView) -> None:
        """(every round view the daemon asks for) ``stale``: if the daemon trains next (the
        round loop's own test: ``NodeDaemon._loop``), θ goes back ``STALE_ROUNDS`` rounds."""
        d = self.node
        if self.kind != "stale" or d.joined is None or d.pending is not None:
            return
        self._check()
        trains = (
            view.round == d.worker.round
            and view.state == RoundState.OPEN
            and view.expected
            and not view.submitted
        )
        if trains and self.today is None:
            await d.compute(self._go_back, view.round)

    def _go_back(self, round_: int) -> None:
        worker = self.node.worker
        now = {n: t.clone() for n, t in worker.params.items()}
        self.history.append(now)
        del self.history[: -(STALE_ROUNDS + 1)]
        old = self.history[0]
        if old is now:
            return  # nothing older yet: this round trains from θ
        base = worker.fingerprint()
        worker.reset_theta(old)
        self.today = (now, base)
        self.claims[round_] = base  # it claims today's θ

    async def restore(self) -> None:
        """``stale``: today's θ back once the daemon trained (or went on without training)."""
        if self.today is not None:
            now, base = self.today
            self.today = None
            await self.node.compute(self.node.worker.reset_theta, now, base)

    # -- the payload -------------------------------------------------------------------------------

    async def payload(self, round_: int, honest_sha: str) -> bytes | None:
        """The bytes to upload instead of the honest payload ``honest_sha`` of ``round_``; None:
        the honest ones (``stale``, a first ``replay``, or not the daemon's pending payload)."""
        await self.restore()
        if honest_sha in self.swaps:
            return self.swaps[honest_sha]
        pending = self.node.pending
        if self.kind == "stale" or pending is None or pending.round != round_:
            return None
        if pending.sha256 != honest_sha:
            return None
        self._check()
        data = await self.node.compute(self._encode, pending)
        if data is not None:
            self.swaps[honest_sha] = data
            self.sizes[round_] = len(data)
        return data

    def _encode(self, pending: PendingRound) -> bytes | None:
        """(compute thread) The hostile payload of the round ``pending`` trained."""
        worker = self.node.worker
        recon = worker.recon[pending.round]  # the honest ĉ
        before = {n: worker.error[n] + recon[n] for n in recon}  # β·e + Δ
        previous = None
        if self.kind == "replay":
            last = max((r for r in self.gathered if r < pending.round), default=None)
            blobs = self.gathered.get(last, {}) if last is not None else {}
            peers = sorted(n for n in blobs if n != worker.node_id)
            if not peers:
                return None  # nothing to copy yet: the honest payload this once
            previous = decode(blobs[peers[0]], worker.shapes)
        tensors = hostile_tensors(
            self.kind, recon, before, seed=self.seed * 1_000_003 + worker.round,
            previous=previous,
        )  # fmt: skip
        data, _ = encode(
            tensors,
            topk=worker.run.topk,
            tile=worker.run.tile,
            run_id=worker.run_id,
            round=pending.round,
            node_id=worker.node_id,
            base=pending.base,
            # The work the honest payload carried: the submit claims it, and a header that
            # says otherwise fails validation before any screening is reached.
            steps=pending.steps or 0,
            tokens=pending.tokens or 0,
        )
        return data

    def sent(self, data: bytes) -> bytes:
        """What goes to the store for ``data``: its hostile replacement, if it has one."""
        return self.swaps.get(_sha(data), data)

    # -- replay: what the gather sets held ---------------------------------------------------------

    def manifest(self, round_: int, view: ManifestView) -> None:
        for node_id, url in view.urls.items():
            self.urls[url] = (round_, node_id)
        for url in [u for u, (r, _) in self.urls.items() if r < round_ - 1]:
            del self.urls[url]

    def downloaded(self, url: str, data: bytes) -> None:
        if self.kind != "replay" or url not in self.urls:
            return
        round_, node_id = self.urls[url]
        self.gathered.setdefault(round_, {})[node_id] = data
        for r in [r for r in self.gathered if r < round_ - 1]:
            del self.gathered[r]


class HostileApi:
    """``CoordinatorApi`` around the real client: grants, submits and reports for the hostile
    payload instead of the honest one; ``stale`` steps θ back and forth around training."""

    def __init__(self, inner: CoordinatorApi, hostile: Hostile) -> None:
        self.inner = inner
        self.hostile = hostile

    async def join(self, client: str = "") -> JoinResponse:
        return await self.inner.join(client)

    async def heartbeat(self, condition: NodeCondition | None = None) -> RoundView:
        return await self.inner.heartbeat(condition)

    def say(self, condition: Callable[[], NodeCondition]) -> None:
        self.inner.say(condition)

    def heard(self) -> Heard | None:
        return self.inner.heard()

    async def leave(self) -> None:
        await self.hostile.restore()
        await self.inner.leave()

    async def round(self) -> RoundView:
        view = await self.inner.round()
        await self.hostile.before_round(view)
        return view

    async def upload_grant(
        self, round_: int, size: int, sha256: str, parts: PartPlan | None = None
    ) -> UploadGrant:
        data = await self.hostile.payload(round_, sha256)
        if data is not None:
            size, sha256 = len(data), _sha(data)
            if parts is not None:
                parts = multipart.part_plan(data)
        return await self.inner.upload_grant(round_, size, sha256, parts)

    async def upload_complete(self, round_: int, request: UploadComplete) -> UploadDone:
        return await self.inner.upload_complete(round_, request)

    async def submit(self, round_: int, request: SubmitRequest) -> SubmitResponse:
        update: dict[str, object] = {}
        data = self.hostile.swaps.get(request.sha256)
        if data is not None:
            update.update(size=len(data), sha256=_sha(data))
        if round_ in self.hostile.claims:
            update["base_fingerprint"] = self.hostile.claims[round_]
        return await self.inner.submit(round_, request.model_copy(update=update))

    async def manifest(self, round_: int) -> ManifestView | RoundView:
        await self.hostile.restore()
        out = await self.inner.manifest(round_)
        if isinstance(out, ManifestView):
            self.hostile.manifest(round_, out)
        return out

    async def report(self, round_: int, report: RoundReport) -> None:
        if report.bytes_up and round_ in self.hostile.sizes:  # the bytes it uploaded
            report = report.model_copy(update={"bytes_up": self.hostile.sizes[round_]})
        await self.inner.report(round_, report)

    async def checkpoint_grant(self, round_: int, offer: CheckpointUpload) -> UploadGrant:
        return await self.inner.checkpoint_grant(round_, offer)

    async def checkpoint_complete(self, round_: int, request: UploadComplete) -> UploadDone:
        return await self.inner.checkpoint_complete(round_, request)

    async def checkpoint_commit(self, round_: int, offer: CheckpointUpload) -> CheckpointInfo:
        return await self.inner.checkpoint_commit(round_, offer)

    async def checkpoints(self) -> list[CheckpointView]:
        return await self.inner.checkpoints()

    async def dataset(self) -> DatasetView:
        return await self.inner.dataset()

    async def dataset_files(self, names: list[str]) -> DatasetFiles:
        return await self.inner.dataset_files(names)


class HostileTransfers:
    """``Transfers`` around the real ones: the hostile payload goes up in place of the honest
    one; ``replay`` remembers the gather sets it downloads."""

    def __init__(self, inner: Transfers, hostile: Hostile) -> None:
        self.inner = inner
        self.hostile = hostile

    async def put(self, url: str, headers: Mapping[str, str], data: bytes) -> bool:
        return await self.inner.put(url, headers, self.hostile.sent(data))

    async def put_parts(
        self, grant: MultipartGrant, data: bytes, done: dict[int, CompletedPart] | None = None
    ) -> list[CompletedPart]:
        return await self.inner.put_parts(grant, self.hostile.sent(data), done)

    async def get(self, url: str, *, size: int, sha256: str) -> bytes:
        data = await self.inner.get(url, size=size, sha256=sha256)
        self.hostile.downloaded(url, data)
        return data

    async def put_file(
        self, url: str, headers: Mapping[str, str], path: Path, *, size: int
    ) -> bool:
        return await self.inner.put_file(url, headers, path, size=size)

    async def put_file_parts(
        self, grant: MultipartGrant, path: Path, *, size: int
    ) -> list[CompletedPart]:
        return await self.inner.put_file_parts(grant, path, size=size)

    async def get_to_file(self, url: str, path: Path, *, size: int, sha256: str) -> None:
        await self.inner.get_to_file(url, path, size=size, sha256=sha256)


async def serve_hostile(settings: NodeSettings, kind: str) -> int:
    """``node.daemon.serve.serve`` with the HTTP seams wrapped: a ``kind`` hostile node."""
    hostile = Hostile(kind)
    async with http_seams(settings) as seams:
        daemon = NodeDaemon(
            settings,
            HostileApi(seams.api, hostile),
            HostileTransfers(seams.transfers, hostile),
            links=seams.links,
        )
        hostile.daemon = daemon
        return await daemon.run()


def run_hostile_node(settings: NodeSettings, kind: str) -> int:
    """``node.daemon.serve.run_node`` for a hostile node (one process, on uvloop)."""
    if torchrun_world() >= 1:
        raise ConfigError("a hostile test node is one process, not under torchrun")
    return_large_blocks()
    import uvloop

    return uvloop.run(serve_hostile(settings, kind))
