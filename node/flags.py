"""Flags that several commands take with one meaning: the overlap schedule, where the inner steps
run, and the caps on a node's transfers.

``simulate``, ``up`` and ``node`` set some of the same things of a run or a node. Each such flag
is declared here once, with a help text that is true for every command using it, so what
``--overlap merge`` or ``--device auto`` means is written in one place; what differs between the
commands (whose steps or transfers, the default, an environment variable) is a parameter. The
connection flags of ``node``, ``doctor`` and ``export`` are ``node.tools.commands``'s.
Light, like ``node.subcommand``: the parser is built without importing the product.
"""

from __future__ import annotations

from node.subcommand import Flag, flag

#: The values of ``RunConfig.overlap``, as ``--overlap`` takes them.
OVERLAP_CHOICES = ("off", "delayed", "eager", "merge")

#: ``--overlap``, ``--overlap-tau`` and ``--overlap-rows``: the run's overlap schedule
#: (``simulate``, ``up``).
OVERLAP_FLAGS = (
    flag(
        "--overlap",
        nargs="?",
        const="merge",
        choices=OVERLAP_CHOICES,
        help="SparseLoCo: let each round's transfers overlap the next round's training; 'merge'"
        " (the default with the flag) merges the aggregate into that training a quarter into"
        " its first step (or at --overlap-tau, --overlap-rows); 'delayed' applies it one round"
        " late, 'eager' too but starts that"
        " training with an estimate of it applied (docs/benchmarks.md §12)",
    ),
    flag(
        "--overlap-tau",
        type=int,
        help="with --overlap merge: the inner step (1..H) after which the aggregate in flight"
        " is merged (default: the run config's, docs/benchmarks.md §12)",
    ),
    flag(
        "--overlap-rows",
        type=int,
        help="with --overlap merge: merge inside step --overlap-tau, after the gradients of"
        " this many rows of its batch (1..batch size - 1); the rest of the step's rows are"
        " taken at the merged parameters (default: the run config's, docs/benchmarks.md §12)",
    ),
)


def device_flag(
    whose: str,
    default: str,
    *,
    more: str = "",
    on_cpu: str = "θ stays on the CPU",
    fill: bool = False,
) -> Flag:
    """``--device``: where ``whose`` inner steps run (``node.compute.placement``).

    ``default`` is what the command runs on without the flag (argparse fills it in when
    ``fill``; otherwise the command's config does), ``more`` what the command takes besides one
    device, ``on_cpu`` where the rest of the node's state is."""
    return flag(
        "--device",
        help=f"where {whose} inner steps run: auto (the first GPU if there is one, else the CPU),"
        f" cpu or cuda:N{more} (default: {default}); {on_cpu}",
        **({"default": default} if fill else {}),
    )


def transfer_limit_flags(whose: str, *, env: bool = False) -> tuple[Flag, ...]:
    """``--upload-limit`` and ``--download-limit``: caps on ``whose`` transfers to the store, in
    ``node.daemon.ratelimit``'s units; ``env``: the node's environment variables name them too."""
    return tuple(
        flag(
            f"--{way}-limit",
            help=f"cap {whose} {way}s to the store, e.g. 100Mbit or 12.5MB (per second"
            + (f"; or SPARSELOCO_NODE_{way.upper()}_LIMIT)" if env else ")"),
        )
        for way in ("upload", "download")
    )
