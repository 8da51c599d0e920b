"""The daemon with its HTTP seams: ``run_node`` is what ``sparseloco node`` runs.

It builds the coordinator client (``node.daemon.client``) and the presigned transfers
(``node.daemon.transfer``, with the node's bandwidth caps) over one aiohttp session
(``http_seams``, which the tests' hostile nodes wrap: ``tests/support/hostile.py``), and runs a
``node.daemon.loop.NodeDaemon`` with them on uvloop. Under torchrun (``WORLD_SIZE`` > 1) each
process takes its part of one node instead (``node.daemon.ranks``): rank 0 runs the daemon,
whose every compute step the other ranks take with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import aiohttp

from node.compute.group import Group
from node.compute.heap import return_large_blocks
from node.daemon.client import ClientTimeouts, CoordinatorClient
from node.daemon.instance import claim
from node.daemon.loop import NodeDaemon
from node.daemon.ranks import run_ranks, torchrun_world
from node.daemon.ratelimit import Limits
from node.daemon.retry import FOREVER, Link
from node.daemon.settings import NodeSettings
from node.daemon.tls import connector
from node.daemon.transfer import HttpTransfers
from node.daemon.transferopts import TransferTimeouts


@dataclass(frozen=True)
class Seams:
    """The daemon's HTTP seams over one session, and their links (for the reports' retries)."""

    api: CoordinatorClient
    transfers: HttpTransfers
    links: tuple[Link, ...]


@contextlib.asynccontextmanager
async def http_seams(settings: NodeSettings) -> AsyncIterator[Seams]:
    """The coordinator client and the presigned transfers of ``settings``, over one aiohttp
    session that closes when the block ends."""
    timeouts = ClientTimeouts(
        connect_s=settings.connect_timeout_s, request_s=settings.request_timeout_s
    )
    transfer_timeouts = TransferTimeouts(
        connect_s=settings.connect_timeout_s, transfer_s=settings.transfer_timeout_s
    )
    policy = replace(FOREVER, budget_s=settings.outage_budget_s)
    instance = claim(settings.state_dir)  # who we are, and who ran here before
    async with aiohttp.ClientSession(connector=connector(settings.ca_cert)) as http:
        api = CoordinatorClient(
            http,
            settings.coordinator,
            settings.token,
            timeouts=timeouts,
            policy=policy,
            instance=instance.id,
            previous_instance=instance.previous,
            on_joined=instance.bound,
        )
        transfers = HttpTransfers(http, transfer_timeouts, limits=Limits.of(settings))
        api.link.behind = transfers.link  # a 503 storage_unavailable: the store is down
        yield Seams(api, transfers, (api.link, transfers.link))


async def serve(settings: NodeSettings, group: Group | None = None) -> int:
    """The daemon with its HTTP seams: the coordinator client and presigned transfers; with
    ``group`` (rank 0 of a torchrun node) its compute runs on all of the node's processes."""
    async with http_seams(settings) as seams:
        daemon = NodeDaemon(settings, seams.api, seams.transfers, links=seams.links, group=group)
        return await daemon.run()


def run_node(settings: NodeSettings) -> int:
    """Run a node to completion on uvloop; the exit status."""
    return_large_blocks()  # freed tensors go back to the system (node.compute.heap)
    if torchrun_world() >= 1:  # under torchrun, one process or more
        return run_ranks(settings, serve)
    import uvloop

    return uvloop.run(serve(settings))
