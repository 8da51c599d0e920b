"""The daemon with its HTTP seams: ``run_node`` is what ``sparseloco node`` runs.

It builds the coordinator client (``node.daemon.client``) and the presigned transfers
(``node.daemon.transfer``, with the node's bandwidth caps) over one aiohttp session, and runs a
``node.daemon.loop.NodeDaemon`` with them on uvloop.
"""

from __future__ import annotations

from dataclasses import replace

import aiohttp

from node.daemon.client import ClientTimeouts, CoordinatorClient
from node.daemon.instance import claim
from node.daemon.loop import NodeDaemon
from node.daemon.ratelimit import Limits
from node.daemon.retry import FOREVER
from node.daemon.settings import NodeSettings
from node.daemon.tls import connector
from node.daemon.transfer import HttpTransfers, TransferTimeouts


async def serve(settings: NodeSettings) -> int:
    """The daemon with its HTTP seams: the coordinator client and presigned transfers."""
    timeouts = ClientTimeouts(
        connect_s=settings.connect_timeout_s, request_s=settings.request_timeout_s
    )
    transfer_timeouts = TransferTimeouts(
        connect_s=settings.connect_timeout_s, transfer_s=settings.transfer_timeout_s
    )
    policy = replace(FOREVER, budget_s=settings.outage_budget_s)
    instance, previous = claim(settings.state_dir)  # who we are, and who ran here before
    async with aiohttp.ClientSession(connector=connector(settings.ca_cert)) as http:
        api = CoordinatorClient(
            http,
            settings.coordinator,
            settings.token,
            timeouts=timeouts,
            policy=policy,
            instance=instance,
            previous_instance=previous,
        )
        transfers = HttpTransfers(http, transfer_timeouts, limits=Limits.of(settings))
        daemon = NodeDaemon(settings, api, transfers, links=(api.link, transfers.link))
        return await daemon.run()


def run_node(settings: NodeSettings) -> int:
    """Run a node to completion on uvloop; the exit status."""
    import uvloop

    return uvloop.run(serve(settings))
