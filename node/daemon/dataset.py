"""Streaming the run's dataset from the object store: the manifest once, shards as training
reaches them.

When the run names a dataset (``RunConfig.dataset``), ``open_dataset`` asks the coordinator for
a presigned GET of the manifest, downloads it and checks that its sha256 is the id the run
names; the manifest in turn pins every shard's sha256. The shards land in the node's state
directory (``datasets/{hex}/shards/``), each written to a temporary name and renamed once its
digest checked out, so a file under its own name is always whole and correct.

``ShardFetcher`` is the ``Fetch`` the compute thread's ``ShardStream`` calls:

- ``wait=True`` (training reached a shard that is not there yet, or the evaluation shards at
  start): the compute thread blocks until the download finished, while the event loop keeps
  heartbeating; a stop request ends the wait with ``Abandoned``;
- ``wait=False`` (the read-ahead, each time a shard is opened): the next shards of the slot are
  downloaded in the background, at most ``PARALLEL`` at once.

Downloads go through the daemon's ``Transfers`` (bounded retries, the node's bandwidth caps)
with URLs asked for per batch of files, just in time, so none outlives its presigning. The
folder keeps at most ``keep`` train shards besides the held-out ones: the oldest are deleted
first, so a node never holds more than a few shards of a dataset of any size.

On a node of several processes (``node.daemon.ranks``) only rank 0 downloads; the other ranks
read the same folder through ``follower_stream``, waiting for each shard to appear there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from node.compute.data import check_vocabulary
from node.compute.model import get_preset
from node.compute.stream import ShardStream
from node.daemon.api import CoordinatorApi, Transfers
from node.daemon.settings import NodeSettings
from node.errors import Abandoned, CoordinatorError, DataError, TransferError
from protocol.causes import cause
from protocol.dataset import (
    MANIFEST_FILE,
    MAX_DATASET_FILES,
    DatasetManifest,
    ShardInfo,
    dataset_hex,
    parse_manifest,
)
from protocol.runconfig import RunConfig

log = logging.getLogger("sparseloco.dataset")

#: Shard downloads at once.
PARALLEL = 2
#: Train shards kept on disk (besides the held-out ones) before the oldest are deleted.
KEEP = 6
#: How often a waiting compute thread looks at the stop request.
_POLL_S = 0.5
#: Longest pause between two tries of a shard the node waits for.
RETRY_MAX_S = 30.0
#: How often a follower waiting for a shard file looks again, and how long it waits at most.
SHARD_POLL_S = 0.2
SHARD_WAIT_S = 24 * 3600.0


class ShardFetcher:
    """Downloads the shards a ``ShardStream`` asks for into ``root`` (see module doc)."""

    def __init__(
        self,
        api: CoordinatorApi,
        transfers: Transfers,
        manifest: DatasetManifest,
        root: Path,
        loop: asyncio.AbstractEventLoop,
        stop: threading.Event,
        *,
        keep: int = KEEP,
    ) -> None:
        self.api = api
        self.transfers = transfers
        self.manifest = manifest
        self.root = root
        self.loop = loop
        self.stop = stop
        self.keep = keep
        self.sizes = manifest.files()
        self.held = {s.name for s in manifest.shards if s.split == "eval"}
        self._inflight: dict[str, asyncio.Future[None]] = {}
        self._gate = asyncio.Semaphore(PARALLEL)
        #: Shards downloaded by this process, and bytes (for the node's report).
        self.fetched = 0
        self.bytes = 0

    # -- the compute thread's side ------------------------------------------------------------

    def __call__(self, shards: Sequence[ShardInfo], *, wait: bool) -> None:
        if not wait:
            future = asyncio.run_coroutine_threadsafe(self.fetch(list(shards)), self.loop)
            future.add_done_callback(_quiet)
            return
        # Training cannot go on without the shard: an outage of the store or the coordinator
        # is waited out (with fresh URLs each try), however long, until a stop request.
        pause = 1.0
        while True:
            future = asyncio.run_coroutine_threadsafe(self.fetch(list(shards)), self.loop)
            try:
                self._wait(future)
                return
            except (ConnectionError, TransferError) as exc:
                _retrying("shard_fetch_retry", pause, exc)
            except CoordinatorError as exc:
                if exc.status < 500:
                    raise DataError(f"the coordinator refuses the dataset's files: {exc}") from exc
                _retrying("shard_fetch_retry", pause, exc)
            if self.stop.wait(pause):
                raise Abandoned()
            pause = min(RETRY_MAX_S, 2 * pause)

    def _wait(self, future: concurrent.futures.Future[None]) -> None:
        while True:
            try:
                future.result(timeout=_POLL_S)
                return
            except concurrent.futures.TimeoutError:
                if self.stop.is_set():
                    future.cancel()
                    raise Abandoned() from None

    # -- the event loop's side ----------------------------------------------------------------

    async def fetch(self, shards: list[ShardInfo]) -> None:
        """Every shard of ``shards`` present and verified under ``root`` (joining downloads
        already under way)."""
        missing = [s for s in shards if not (self.root / s.name).is_file()]
        new = [s for s in missing if s.name not in self._inflight]
        for start in range(0, len(new), MAX_DATASET_FILES):
            batch = new[start : start + MAX_DATASET_FILES]
            task = asyncio.ensure_future(self._download(batch))
            for s in batch:
                self._inflight[s.name] = task
        waits = {id(f): f for f in (self._inflight.get(s.name) for s in missing) if f}
        if waits:
            await asyncio.gather(*(asyncio.shield(f) for f in waits.values()))

    async def _download(self, batch: list[ShardInfo]) -> None:
        try:
            grant = await self.api.dataset_files([s.name for s in batch])
            missing = [s.name for s in batch if s.name not in grant.urls]
            if missing:  # retried like an outage: the next grant may be whole
                raise TransferError(f"the coordinator sent no URL for {missing[0]}")
            await asyncio.gather(*(self._one(s, grant.urls[s.name]) for s in batch))
        finally:
            for s in batch:
                self._inflight.pop(s.name, None)
        self._evict(protect={s.name for s in batch})

    async def _one(self, info: ShardInfo, url: str) -> None:
        async with self._gate:
            data = await self.transfers.get(url, size=self.sizes[info.name], sha256=info.sha256)
        path = self.root / info.name
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_bytes(data)
        os.replace(partial, path)
        self.fetched += 1
        self.bytes += len(data)
        log.info("event=shard_fetched shard=%s bytes=%d", info.name, len(data))

    def _evict(self, protect: set[str]) -> None:
        """Delete the oldest train shards beyond ``keep`` (never held-out or just fetched)."""
        folder = self.root / "shards"
        if not folder.is_dir():
            return
        train = [
            p
            for p in folder.glob("*.bin")
            if f"shards/{p.name}" not in self.held and f"shards/{p.name}" not in protect
        ]
        excess = len(train) + len(protect) - self.keep
        for path in sorted(train, key=lambda p: p.stat().st_mtime)[: max(0, excess)]:
            path.unlink(missing_ok=True)


def _retrying(event: str, pause: float | None, exc: BaseException) -> None:
    """A failed fetch that will be tried again. A service that stopped answering was logged once
    by its link (``node.daemon.retry.Link``): each try of it only at DEBUG; anything else (an
    expired URL, a refusal) is a WARNING with its cause in a few words."""
    when = "" if pause is None else f" in_s={pause:.0f}"
    log.debug("event=%s%s error=%r", event, when, exc)
    if not isinstance(exc, ConnectionError):
        log.warning("event=%s%s cause=%r", event, when, cause(exc))


def _quiet(future: concurrent.futures.Future[None]) -> None:
    """A read-ahead's outcome: a failure is logged, and the waiting fetch will meet it again."""
    if not future.cancelled() and future.exception() is not None:
        exc = future.exception()
        assert exc is not None
        _retrying("read_ahead_failed", None, exc)


@dataclass(frozen=True)
class DatasetSource:
    """Where a node's copy of the run's dataset comes from: the coordinator (``api``) and the
    store (``transfers``), into a folder of ``state_dir``, or ``local`` (``--data``), a folder of
    the same dataset already on this machine; ``stop`` ends the fetching."""

    api: CoordinatorApi
    transfers: Transfers
    run: RunConfig
    state_dir: Path
    local: str | None
    stop: threading.Event


async def open_dataset(source: DatasetSource) -> tuple[ShardStream, ShardFetcher]:
    """The stream of the run's dataset for this node, its manifest checked against the id.

    A ``local`` folder is used as is (shards it lacks are still fetched); anything else with a
    run that names a dataset is a ``DataError``.
    """
    api, transfers, run, local = source.api, source.transfers, source.run, source.local
    dataset = run.dataset
    if dataset is None:
        raise ValueError("the run names no dataset")
    ctx_len = get_preset(run.model).ctx_len
    root = source.state_dir / "datasets" / dataset_hex(dataset)
    if local is not None:
        root = _local_root(local, dataset)
    view = await api.dataset()
    if view.dataset != dataset:
        raise DataError(f"the coordinator serves dataset {view.dataset}, the run names {dataset}")
    path = root / MANIFEST_FILE
    try:
        manifest = parse_manifest(path.read_bytes(), dataset) if path.is_file() else None
    except ValueError:
        manifest = None
    if manifest is None:
        data = await transfers.get(
            view.manifest_url, size=view.manifest_size, sha256=dataset_hex(dataset)
        )
        try:
            manifest = parse_manifest(data, dataset)
        except ValueError as exc:
            raise DataError(f"the run's dataset manifest is not usable: {exc}") from exc
        root.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    check_vocabulary(manifest, get_preset(run.model).vocab_size, where=f"dataset {dataset}")
    fetcher = ShardFetcher(api, transfers, manifest, root, asyncio.get_running_loop(), source.stop)
    stream = ShardStream(root, manifest, ctx_len=ctx_len, fetch=fetcher)
    log.info(
        "event=dataset_opened dataset=%s shards=%d tokens=%d folder=%s",
        dataset,
        len(manifest.shards),
        manifest.total_tokens,
        root,
    )
    return stream, fetcher


def _local_root(local: str, dataset: str) -> Path:
    root = Path(local)
    path = root / MANIFEST_FILE
    if not path.is_file():
        raise DataError(
            f"the run trains on dataset {dataset}, streamed from the store; --data {local} is"
            " not a prepared dataset folder: leave --data out, or give a folder of that dataset"
        )
    try:
        parse_manifest(path.read_bytes(), dataset)
    except ValueError as exc:
        raise DataError(f"--data {local} is another dataset than the run's: {exc}") from exc
    return root


async def open_run_data(
    api: CoordinatorApi,
    transfers: Transfers,
    run: RunConfig,
    settings: NodeSettings,
    *,
    stop: threading.Event,
    sleep: Callable[[float], Awaitable[None]],
) -> ShardStream | None:
    """The run's dataset streamed from the store, when it names one (waiting out outages);
    None: the node's ``--data`` (or the demo corpus)."""
    if run.dataset is None:
        return None
    source = DatasetSource(
        api, transfers, run, settings.state_dir, local=settings.data, stop=stop
    )  # fmt: skip
    stream, _ = await open_waiting(source, sleep=sleep)
    return stream


async def open_waiting(
    source: DatasetSource, *, sleep: Callable[[float], Awaitable[None]]
) -> tuple[ShardStream, ShardFetcher]:
    """``open_dataset``, waiting out an outage of the store or the coordinator (a refusal is
    raised); ``Abandoned`` once the source's ``stop`` is set."""
    pause = 1.0
    while True:
        try:
            return await open_dataset(source)
        except (ConnectionError, TransferError) as exc:
            _retrying("dataset_retry", pause, exc)
        except CoordinatorError as exc:
            if exc.status < 500:
                raise
            _retrying("dataset_retry", pause, exc)
        await sleep(pause)
        if source.stop.is_set():
            raise Abandoned()
        pause = min(RETRY_MAX_S, 2 * pause)


# -- the other ranks of a torchrun node (node.daemon.ranks) ----------------------------------------


class SharedFolder:
    """A follower's ``Fetch`` for the run's dataset: rank 0 downloads every shard the node
    trains on (it trains on the same step at the same time), so a follower waits for the file
    to appear in the shared folder; rank 0 also does the read-ahead."""

    def __init__(self, root: Path, stop: threading.Event) -> None:
        self.root = root
        self.stop = stop

    def __call__(self, shards: Sequence[ShardInfo], *, wait: bool) -> None:
        if not wait:
            return
        deadline = time.monotonic() + SHARD_WAIT_S
        for info in shards:
            while not (self.root / info.name).is_file():
                if self.stop.is_set():
                    raise Abandoned()
                if time.monotonic() > deadline:
                    raise DataError(f"shard {info.name} never appeared in {self.root}")
                time.sleep(SHARD_POLL_S)


def follower_stream(root: Path, run: RunConfig, stop: threading.Event) -> ShardStream:
    """The run's dataset as a follower reads it: the folder rank 0 streams it into (``stop``
    ends a wait for a shard)."""
    try:
        manifest = parse_manifest((root / MANIFEST_FILE).read_bytes(), run.dataset)
    except (OSError, ValueError) as exc:
        raise DataError(f"{root}: the run's dataset manifest is not readable here: {exc}") from exc
    ctx_len = get_preset(run.model).ctx_len
    return ShardStream(root, manifest, ctx_len=ctx_len, fetch=SharedFolder(root, stop))
