"""The run's prepared dataset, as the coordinator serves it: presigned GETs, nothing more.

A run that names a dataset (``RunConfig.dataset``, the sha256 of its manifest) trains on the
files ``sparseloco data prepare --upload`` put under ``{prefix}/datasets/{hex}/``. The
coordinator reads that manifest once, checks it hashes to the id the run names, and from then
on presigns a GET for any file it lists, and for no other key: a node's token buys read access
to the run's data and to nothing else in the bucket. The nodes check every byte themselves (the
manifest against the id, each shard against the manifest), so the coordinator is not trusted
with the data's integrity, only with handing out the way to it.

A dataset missing from the store is the operator's mistake, not the nodes': ``serve`` refuses
to start without it (``check_dataset``), and should it vanish later the endpoints answer 503,
which nodes wait out like any store outage.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

from coordinator.base.errors import ApiError, StartupError, StorageError
from coordinator.store.object_store import ObjectStore
from protocol.dataset import (
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    TOKENIZER_FILE,
    DatasetManifest,
    dataset_hex,
    dataset_key,
)
from protocol.dataset import parse_manifest as parse

log = logging.getLogger("sparseloco.coordinator.datasets")


class DatasetBook:
    """The run's dataset manifest, read from the store on first use and kept."""

    def __init__(self, store: ObjectStore, dataset: str | None, *, prefix: str) -> None:
        self.store = store
        self.dataset = dataset
        self.prefix = prefix
        self._manifest: DatasetManifest | None = None
        self._files: frozenset[str] = frozenset()
        self._lock = asyncio.Lock()
        #: Bytes of the manifest file, once read.
        self.manifest_size = 0

    def key(self, name: str) -> str:
        if self.dataset is None:
            raise ApiError(404, "no_dataset", "this run names no dataset: nodes use local data")
        return dataset_key(self.prefix, self.dataset, name)

    async def manifest(self) -> DatasetManifest:
        """The manifest; 404 ``no_dataset`` for a run without one, 503 ``dataset_unavailable``
        while it is not in the store (or not the one the run names)."""
        if self._manifest is not None:
            return self._manifest
        key = self.key(MANIFEST_FILE)
        async with self._lock:
            if self._manifest is None:
                data = await self.store.get_bytes(key, MAX_MANIFEST_BYTES)
                if data is None:
                    raise ApiError(
                        503,
                        "dataset_unavailable",
                        f"the run's dataset {self.dataset} is not in the store (no {key});"
                        " upload it with `sparseloco data prepare ... --upload`",
                    )
                try:
                    manifest = parse(data, self.dataset)
                    if hashlib.sha256(data).hexdigest() != dataset_hex(self.dataset or ""):
                        raise ValueError(
                            "it is not in canonical form (nodes check the file's sha256);"
                            " upload it again with `sparseloco data prepare ... --upload`"
                        )
                except ValueError as exc:
                    raise ApiError(
                        503, "dataset_unavailable", f"{key} is not the run's dataset: {exc}"
                    ) from exc
                files = set(manifest.files())
                if manifest.tokenizer.kind == "bpe":
                    files.add(TOKENIZER_FILE)
                self._files = frozenset(files)
                self.manifest_size = len(data)
                self._manifest = manifest
                log.info(
                    "event=dataset_loaded dataset=%s shards=%d tokens=%d",
                    self.dataset,
                    len(manifest.shards),
                    manifest.total_tokens,
                )
        return self._manifest

    async def urls(self, names: list[str]) -> dict[str, str]:
        """A presigned GET for each of ``names``; 404 ``unknown_file`` if the manifest does
        not list one of them."""
        await self.manifest()
        unknown = [n for n in names if n not in self._files]
        if unknown:
            raise ApiError(
                404,
                "unknown_file",
                f"the run's dataset has no file {unknown[0]!r}",
                "names",
            )
        return {n: self.store.presign_get(self.key(n)) for n in names}


async def check_dataset(book: DatasetBook) -> None:
    """Before serving: the dataset the run names is in the store and is that dataset."""
    if book.dataset is None:
        return
    try:
        await book.manifest()
    except (ApiError, StorageError) as exc:
        raise StartupError(
            f"{exc} (run.dataset in the coordinator's config names the dataset; storage.prefix"
            " must be the --prefix it was uploaded with)"
        ) from exc
