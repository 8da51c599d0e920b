"""The coordinator's dataset endpoints against the real store (SeaweedFS): it presigns the files
the run's dataset manifest lists and nothing else, refuses to start without the dataset, and
refuses a manifest that is not the one the run names (``coordinator/store/datasets.py``)."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest
import requests

from coordinator.base.errors import StartupError
from coordinator.store.datasets import DatasetBook, check_dataset
from node.cluster.seaweed import EmbeddedStore
from node.tools.shards import prepare, upload
from protocol.dataset import DatasetManifest, dataset_key
from protocol.runconfig import RunConfig
from support.api import ApiFactory

CORPUS = Path(__file__).parent.parent / "node" / "corpus"


@pytest.fixture(scope="module")
def bytes_dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DatasetManifest]:
    """Byte-level shards of one play: 2,000 ids each, every 20th held out."""
    out = tmp_path_factory.mktemp("ds")
    manifest = prepare([str(CORPUS / "macbeth_gut.txt")], out, shard_tokens=2000)
    return out, manifest


def _upload(store: EmbeddedStore, root: Path, manifest: DatasetManifest, prefix: str) -> None:
    e = store.endpoint
    upload(
        root, manifest, endpoint=e.endpoint_url, bucket=e.bucket, prefix=prefix,
        credentials=(e.access_key, e.secret_key),
    )  # fmt: skip


@pytest.mark.asyncio
async def test_the_coordinator_presigns_the_datasets_files_and_nothing_else(
    make_api: ApiFactory, store: EmbeddedStore, bytes_dataset: tuple[Path, DatasetManifest]
) -> None:
    root, manifest = bytes_dataset
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    _upload(store, root, manifest, prefix)
    api = await make_api(RunConfig(name="ds", dataset=manifest.dataset_id), prefix=prefix)
    status, view = await api.call("GET", "/v1/dataset", "n0")
    assert status == 200 and view["dataset"] == manifest.dataset_id
    body = requests.get(view["manifest_url"], timeout=30).content
    # The stored manifest is canonical JSON: its own sha256 is the dataset id.
    assert len(body) == view["manifest_size"]
    assert "sha256:" + hashlib.sha256(body).hexdigest() == manifest.dataset_id
    shard = manifest.shards[3]
    status, grant = await api.call("POST", "/v1/dataset/files", "n0", {"names": [shard.name]})
    assert status == 200 and set(grant["urls"]) == {shard.name}
    data = requests.get(grant["urls"][shard.name], timeout=30).content
    assert hashlib.sha256(data).hexdigest() == shard.sha256
    # A name the manifest does not list, or one that is no dataset file at all, gets nothing.
    status, err = await api.call("POST", "/v1/dataset/files", "n0", {"names": ["shards/99999.bin"]})
    assert (status, err["error"]) == (404, "unknown_file")
    for bad in ("../../runs/x/manifest.json", "manifest.json", "shards/1.bin"):
        status, err = await api.call("POST", "/v1/dataset/files", "n0", {"names": [bad]})
        assert (status, err["error"]) == (422, "invalid"), bad
    status, err = await api.call("POST", "/v1/dataset/files", "n0", {"names": ["tokenizer.json"]})
    assert (status, err["error"]) == (404, "unknown_file")  # a byte-level dataset has none
    status, err = await api.call("POST", "/v1/dataset/files", None, {"names": [shard.name]})
    assert status == 401


@pytest.mark.asyncio
async def test_a_run_without_a_dataset_and_a_dataset_missing_from_the_store(
    make_api: ApiFactory, store: EmbeddedStore, bytes_dataset: tuple[Path, DatasetManifest]
) -> None:
    api = await make_api(RunConfig(name="local"))
    status, err = await api.call("GET", "/v1/dataset", "n0")
    assert (status, err["error"]) == (404, "no_dataset")
    _, manifest = bytes_dataset
    api = await make_api(RunConfig(name="gone", dataset=manifest.dataset_id), state="gone")
    status, err = await api.call("GET", "/v1/dataset", "n0")
    assert (status, err["error"]) == (503, "dataset_unavailable")
    assert "sparseloco data prepare" in err["message"]
    # What ``sparseloco-coordinator`` does before it serves: a clear refusal to start.
    with pytest.raises(StartupError, match=r"storage\.prefix"):
        await check_dataset(api.coord.datasets)


@pytest.mark.asyncio
async def test_a_manifest_that_is_not_the_runs_dataset_is_refused(
    store: EmbeddedStore, bytes_dataset: tuple[Path, DatasetManifest]
) -> None:
    """Someone replaced the stored manifest: it no longer hashes to the id, so it is refused."""
    root, manifest = bytes_dataset
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    _upload(store, root, manifest, prefix)
    forged = manifest.model_copy(update={"sources": ["elsewhere"]})
    key = dataset_key(prefix, manifest.dataset_id, "manifest.json")
    store.client().put_object(
        Bucket=store.endpoint.bucket, Key=key, Body=forged.model_dump_json().encode()
    )
    from coordinator.api.app import s3_store
    from support.api import make_config

    config = make_config(
        store, root / "unused", RunConfig(dataset=manifest.dataset_id), prefix=prefix
    )
    book = DatasetBook(s3_store(config), manifest.dataset_id, prefix=prefix)
    with pytest.raises(StartupError, match="hashes to"):
        await check_dataset(book)
