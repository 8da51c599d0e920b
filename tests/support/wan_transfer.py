"""One large synthetic payload through the coordinator and the store, as a node sends it.

Run as a process in a WAN lab node's namespace (``tests/test_wan_transfer.py``)::

    python -m support.wan_transfer URL TOKEN SIZE SEED OUT.json DIR

It joins, uploads ``SIZE`` seeded random bytes as its round-0 payload with the node's own
client and transfers (in parts above ``node.daemon.multipart.MULTIPART_THRESHOLD``, each part
retried alone), has the coordinator complete the upload, submits, waits for the manifest and
downloads the payload back through its presigned GET, once into memory and once into a file in
``DIR`` (ranged parts, resumed after a reset), checking each against the manifest's sha256.
``OUT.json`` gets the timings and the node's ``TransferCounts`` after each phase.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import aiohttp

from node.daemon import multipart
from node.daemon.client import CoordinatorClient
from node.daemon.retry import RetryPolicy
from node.daemon.transfer import HttpTransfers
from protocol.messages import ManifestView, SubmitRequest
from protocol.parts import UploadComplete

#: Any 32 hex digits: round 0 of a fresh run takes any base fingerprint.
BASE = "0" * 32
#: Many attempts, with a budget for a part of 8 MiB on a 20 Mbit/s link shared by four.
POLICY = RetryPolicy(attempts=30, base_s=0.25, max_delay_s=2.0, budget_s=600.0)


async def main(url: str, token: str, size: int, seed: int, out: Path, folder: Path) -> None:
    payload = random.Random(seed).randbytes(size)
    sha = hashlib.sha256(payload).hexdigest()
    result: dict[str, object] = {"size": size}
    async with aiohttp.ClientSession() as http:
        client = CoordinatorClient(http, url, token, policy=POLICY)
        transfers = HttpTransfers(http, policy=POLICY)
        await client.join("wan-transfer")
        plan = multipart.part_plan(payload)
        result["parts"] = 0 if plan is None else len(plan.sha256)
        t0 = time.monotonic()
        grant = await client.upload_grant(0, size, sha, plan)
        if grant.multipart is None:
            await transfers.put(grant.url, grant.headers, payload)
        else:
            parts = await transfers.put_parts(grant.multipart, payload)
            done = UploadComplete(upload_id=grant.multipart.upload_id, parts=parts)
            result["created"] = (await client.upload_complete(0, done)).created
        result["upload_s"] = time.monotonic() - t0
        result["after_upload"] = asdict(transfers.counts)
        answer = await client.submit(0, SubmitRequest(size=size, sha256=sha, base_fingerprint=BASE))
        result["accepted"] = answer.accepted
        view = await client.manifest(0)
        while not isinstance(view, ManifestView):
            view = await client.manifest(0)
        [entry] = view.signed.manifest.gather
        t0 = time.monotonic()
        got = await transfers.get(view.urls[entry.node_id], size=entry.size, sha256=entry.sha256)
        result["download_memory_s"] = time.monotonic() - t0
        result["memory_intact"] = got == payload
        t0 = time.monotonic()
        target = folder / "payload.slc"
        await transfers.get_to_file(
            view.urls[entry.node_id], target, size=entry.size, sha256=entry.sha256
        )
        result["download_file_s"] = time.monotonic() - t0
        result["file_intact"] = target.read_bytes() == payload
        result["after_download"] = asdict(transfers.counts)
        await client.leave()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    url, token, size, seed, out, folder = sys.argv[1:7]
    asyncio.run(main(url, token, int(size), int(seed), Path(out), Path(folder)))
