"""The ``up`` subcommand of ``sparseloco``: its flags, then the local run with its live view.

``sparseloco up`` starts the embedded store, a coordinator and N nodes on this machine
(``node.cluster.up``), shows their progress (``node.cluster.view``), and at the end exports
the final model with ``--export`` (``node.tools.offline``). Flags are checked into an
``UpConfig`` before anything starts; a bad value fails naming its flag. Help texts that list
presets are generated from the tables the code reads (``table_names``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from node.compute.presets import PRESETS as RUN_PRESETS
from node.errors import UpError
from node.flags import OVERLAP_FLAGS, device_flag, transfer_limit_flags
from node.subcommand import Command, flag, values
from protocol.errors import ConfigError, Problem, config_error


def table_names(table: dict[str, Any]) -> str:
    """A table's names for a help text, in the table's order."""
    return ", ".join(table)


def _check_ranks(cfg: Any) -> None:
    """Every process of a node trains on rows of each batch: no more processes than rows."""
    from node.compute.presets import get_run_preset

    batch = get_run_preset(cfg.preset).batch_size
    most = max(cfg.node_ranks(i) or 1 for i in range(cfg.nodes))
    if most > batch:
        raise ConfigError(
            f"--ranks {cfg.ranks}: a node of {most} processes needs a batch of at least {most}"
            f" rows, and preset {cfg.preset!r} has {batch}; use --ranks {batch} or fewer"
        )


def _cmd_up(args: argparse.Namespace) -> int:
    import time

    from pydantic import ValidationError

    from node.cluster.up import UpConfig, process_age_s, up
    from node.cluster.view import UpView
    from node.research.report import write_json

    # Named now: the view's log file lives in it before the run starts.
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("up-%Y%m%d-%H%M%S"))
    try:
        cfg = UpConfig(
            run_dir=run_dir,
            round_timeout_s=args.round_timeout,
            **values(args, *_UP_FIELDS),
        )
    except ValidationError as exc:
        raise config_error(exc, _flag) from exc
    _check_ranks(cfg)
    if any(cfg.node_device(i).startswith("cuda") for i in range(cfg.nodes)):
        from node.compute.placement import resolve_device

        for i in range(cfg.nodes):
            resolve_device(cfg.node_device(i))  # DeviceError before anything starts
    with UpView(cfg.rounds, cfg.nodes, log_path=run_dir / "logs" / "up.log") as view:
        result = up(cfg, on_status=view.update)
    # The whole command so far, the interpreter's start and the store's stop included (``up``'s
    # own wall_seconds starts at the store's start and ends before the stops).
    result["command_seconds"] = process_age_s() or result["wall_seconds"]
    view.summary(result)
    if args.export:
        if result.get("final_model") is None:
            raise UpError("the nodes did not agree on the final model: nothing to export")
        from node.tools.offline import export_run

        done = export_run(Path(result["run_dir"]), Path(args.export))
        print(f"exported θ after round {done['round'] - 1} ({done['format']}) to {args.export}")
    if args.json_out:
        write_json(result, args.json_out)
        print(f"wrote {args.json_out}")
    return 0 if result["fingerprints_agree"] else 1


#: Flags whose dest is the ``UpConfig`` field they set.
_UP_FIELDS = (
    "nodes",
    "rounds",
    "preset",
    "data",
    "overlap",
    "overlap_tau",
    "overlap_rows",
    "upload_limit",
    "download_limit",
    "device",
    "ranks",
)


def _flag(problem: Problem) -> str:
    """A failed field as the flag that sets it: ``--round-timeout: ...``."""
    return f"--{problem.dotted.replace('_', '-')}: {problem.message}"


UP = Command(
    "up",
    help="a whole local run: object store, coordinator and N nodes on this machine",
    description="Start SeaweedFS, a coordinator and N node processes on loopback, train"
    " on the bundled corpus, show progress, and stop everything at the end. Everything"
    " (store, database, node states, logs, the final model) stays in the run folder.",
    run=_cmd_up,
    flags=(
        flag("--nodes", type=int, default=3, help="node processes (default: %(default)s)"),
        flag(
            "--rounds",
            type=int,
            default=5,
            help="rounds of the run (default: %(default)s)",
        ),
        flag(
            "--preset",
            default="tiny",
            help="run shape (node/compute/presets.py; default %(default)s):"
            f" {table_names(RUN_PRESETS)}",
        ),
        flag(
            "--data",
            help="text file, directory or glob, or a folder made by `sparseloco data prepare`"
            " (uploaded to the run's store; the nodes stream it) (default: bundled corpus)",
        ),
        flag("--dir", dest="run_dir", help="run folder (default: runs/up-<time>)"),
        flag(
            "--round-timeout",
            type=float,
            default=120.0,
            help="seconds the first round may take before it closes without the missing nodes;"
            " later deadlines are learnt from the nodes' arrivals, at most this long"
            " (default: %(default)s)",
        ),
        *OVERLAP_FLAGS,
        *transfer_limit_flags("every node's"),
        device_flag(
            "the nodes'",
            "cpu",
            more=" for all, or a list the nodes take in turn, e.g. cuda:0,cuda:0,cpu",
            fill=True,
        ),
        flag(
            "--ranks",
            help="processes per node, as `sparseloco node --ranks` starts them: one count for"
            " all, or a list the nodes take in turn, e.g. 1,2,4; each node shards its model"
            " state over its processes, on their devices (default: one plain process a node)",
        ),
        flag(
            "--export",
            metavar="DIR",
            help="at the end, export the final model here, as `sparseloco export` does (for a"
            " LLaMA-style model a transformers model); the run folder keeps it anyway (final/),"
            " for `sparseloco export --run RUN_DIR` later",
        ),
        flag("--json", dest="json_out", metavar="OUT", help="write the summary here"),
    ),
)
