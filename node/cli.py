"""The ``sparseloco`` console script: one entry point, one subcommand per job.

Subcommands:

- ``up``: a whole local run (embedded object store, coordinator, N nodes), the main job
  (``node.cluster.command``);
- ``node``: the node daemon, joining a coordinator with a token;
- ``coordinator``: the coordinator service and its token administration (``python -m
  coordinator``, run as its own process with every argument passed on, ``--help`` included:
  ``node`` and ``coordinator`` never import each other);
- ``store``: the embedded S3-compatible store for a run on one machine (``node.tools.commands``);
- ``doctor``: can this machine take part in that run (``node.tools.doctor``);
- ``export``: the run's newest checkpoint as a verified safetensors file (``node.tools.export``);
- ``data prepare``: text into tokenised shards with a manifest (``node.tools.shards``);
- ``simulate``: SparseLoCo, DiLoCo and DDP in one process;
- ``bench``: the benchmarks (``node.research.bench.cli``).

Each subcommand is a ``Command`` row (``node.subcommand``): its flags as data and the function
that runs it. It parses its flags into a validated config; bad values fail at start with a
message naming the flag, before anything heavy (torch) is imported.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import get_args

from node.cluster.command import UP, table_names
from node.compute.modelconfig import PRESETS as MODEL_PRESETS
from node.compute.presets import PRESETS as RUN_PRESETS
from node.flags import OVERLAP_FLAGS, device_flag, transfer_limit_flags
from node.research.bench.cli import add_bench
from node.subcommand import Command, flag, values
from node.tools.commands import (
    CONNECTION_FLAGS,
    DOCTOR,
    EXPORT,
    STORE,
    add_data,
    connection_values,
)
from protocol.errors import ConfigError, SparseLoCoError
from protocol.runconfig import WorkRule
from protocol.version import version_line

log = logging.getLogger("sparseloco")


#: Flags whose dest is the ``SimConfig`` field they set (all but ``--preset`` and ``--json``).
_SIM_FIELDS = (
    "algo",
    "model",
    "workers",
    "inner_steps",
    "rounds",
    "batch_size",
    "data",
    "topk",
    "tile",
    "beta",
    "alpha",
    "clip",
    "overlap",
    "overlap_tau",
    "overlap_rows",
    "merge_estimate",
    "inner_lr",
    "outer_lr",
    "seed",
    "device",
    "speeds",
    "link",
    "schedule",
    "wall",
    "work_weight",
    "budget",
)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from node.research.progress import round_progress
    from node.research.report import publish
    from node.research.simulate import build_config, simulate

    cfg = build_config(args.preset, **values(args, *_SIM_FIELDS))
    with round_progress(f"simulate {cfg.algo}", cfg.rounds) as progress:
        result = simulate(cfg, progress=progress)
    summary = (
        f"{cfg.algo}: final eval loss {result['final_eval_loss']:.4f} nats, "
        f"{result['bytes_per_round_per_worker']:,.0f} bytes/round/worker, "
        f"{result['wall_seconds']:.1f} s"
    )
    publish(summary, result, args.json_out)
    return 0


#: ``node``'s flags besides the connection's: keywords of ``load_settings`` of the same names.
_NODE_FIELDS = ("state_dir", "data", "threads", "device", "upload_limit", "download_limit")


def positive_int(text: str) -> int:
    """argparse's type for a count of one or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give 1 or more")
    return value


def _cmd_node(args: argparse.Namespace) -> int:
    from node.daemon.settings import load_settings

    # Settings first: a missing flag is an error in a moment, not after torch has loaded.
    settings = load_settings(**connection_values(args), **values(args, *_NODE_FIELDS))
    from node.daemon.launcher import Launcher, started_world

    if args.ranks is not None:
        world = started_world()
        if world == 0:  # start the node's processes; each runs this command again
            if settings.device not in ("auto", "cpu"):  # one error line, not one per process
                from node.compute.placement import resolve_device

                resolve_device(settings.device)
            command = [sys.executable, "-m", "node", *args.argv]
            return Launcher(command, args.ranks, threads=settings.threads).run()
        if world != args.ranks:
            raise ConfigError(
                f"--ranks {args.ranks} under a launcher that started {world} processes: give"
                " the count once (torchrun's --nproc-per-node, or --ranks without torchrun)"
            )
    from node.compute.placement import resolve_device

    device = resolve_device(settings.device)  # DeviceError now, not after joining
    log.info("event=device device=%s requested=%s", device, settings.device)
    from node.daemon.serve import run_node

    _leave(run_node(settings))
    return 0  # not reached


def _leave(code: int) -> None:
    """End the node process with ``code`` without tearing the interpreter down.

    The daemon has committed its state and closed its connections when it returns; what is
    left is unloading torch and the model's objects, which took about 13 s after every finished
    run on a loaded 2-core machine (most of ``sparseloco up``'s shutdown). First comes what a
    normal exit does first (``threading._shutdown``: idle executor workers are told to stop,
    threads that are not daemons are joined), then the logs are flushed.
    """
    import os
    import threading

    finish_threads = getattr(threading, "_shutdown", None)
    if finish_threads is not None:
        finish_threads()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


SIMULATE = Command(
    "simulate",
    help="run SparseLoCo, DiLoCo or DDP with N workers in one process",
    description="Train N workers in one process on equal token budgets and write JSON.",
    run=_cmd_simulate,
    flags=(
        flag("--algo", required=True, choices=["sparseloco", "diloco", "ddp"]),
        flag("--preset", help=f"run preset (node/compute/presets.py): {table_names(RUN_PRESETS)}"),
        flag(
            "--model",
            help=f"model preset (node/compute/modelconfig.py), overriding the run preset's:"
            f" {table_names(MODEL_PRESETS)}",
        ),
        flag("--workers", type=int),
        flag("--inner-steps", type=int, help="H, inner steps per round"),
        flag("--rounds", type=int),
        flag("--batch-size", type=int, help="sequences per inner step per worker"),
        flag(
            "--data",
            help="text file, directory or glob, or a folder made by `sparseloco data prepare`"
            " (default: bundled demo corpus)",
        ),
        flag("--topk", type=int, help="kept entries per 64x64 tile (default 64)"),
        flag("--tile", type=int, help="tile edge (default 64)"),
        flag("--beta", type=float, help="error-feedback decay (default 0.95)"),
        flag("--alpha", type=float, help="SparseLoCo outer learning rate (default 1.0)"),
        flag(
            "--no-clip",
            dest="clip",
            action="store_false",
            default=None,
            help="disable median-norm clipping of peers",
        ),
        *OVERLAP_FLAGS,
        flag(
            "--merge-estimate",
            action="store_true",
            default=None,
            help="with --overlap merge: start each round from θ less eager's estimate of the"
            " aggregate in flight, taken back at the merge (simulator only; docs/benchmarks.md"
            " §12)",
        ),
        flag("--inner-lr", type=float, help="inner AdamW lr (default by algorithm)"),
        flag("--outer-lr", type=float, help="DiLoCo outer lr (default 0.7)"),
        flag("--seed", type=int),
        device_flag(
            "the workers'", "cpu", on_cpu="θ, the codec and the outer steps stay on the CPU"
        ),
        # Unequal workers (SparseLoCo; node/research/simulate.py, docs/benchmarks.md §18)
        flag(
            "--speeds",
            metavar="V,V,...",
            help="one relative speed per worker, e.g. 1,1,1,0.333 (default: all 1)",
        ),
        flag(
            "--link",
            metavar="T,T,...",
            help="per worker, a round's transfers in inner steps of a speed-1 worker, not"
            " overlapping training, e.g. 0,0,0,5 (default: all 0)",
        ),
        flag(
            "--schedule",
            choices=["wait", "leave_out", "budget", "batch"],
            help="how a round treats unequal workers: wait for the slowest (default), leave"
            " out those over the budget, train until H or the budget, or scale the batch",
        ),
        flag(
            "--wall",
            type=float,
            help="the run's wall time in inner steps of a speed-1 worker (default: rounds x"
            " H); with unequal workers the run is as many rounds as fit in it",
        ),
        flag(
            "--work-weight",
            choices=list(get_args(WorkRule)),
            help="how payloads of unequal steps count: steps (default), mean, per_step",
        ),
        flag(
            "--budget",
            metavar="median|fastest|off|STEPS",
            help="the round's budget: the median or fastest worker's whole round, or that"
            " many step units (default median)",
        ),
        flag("--json", dest="json_out", metavar="OUT", help="write the result here"),
    ),
)

NODE = Command(
    "node",
    help="run a node: join a coordinator and train until the run ends",
    description="The node daemon. The invite (or the token) may also come from the"
    " environment: SPARSELOCO_NODE_INVITE, SPARSELOCO_NODE_TOKEN. At its first join it pins"
    " the run's manifest key in --state-dir (checked against the invite's fingerprint when"
    " there is one) and refuses any other key from then on.",
    run=_cmd_node,
    flags=(
        *CONNECTION_FLAGS,
        flag("--state-dir", help="local state folder (or SPARSELOCO_NODE_STATE_DIR)"),
        flag(
            "--data",
            help="text file, directory or glob; for a run that names a dataset, that dataset's"
            " folder made by `sparseloco data prepare`, read here instead of downloaded (default:"
            " the bundled corpus, or the run's dataset streamed from the store)",
        ),
        flag(
            "--threads",
            type=int,
            help="compute threads, torch's and the codec's (default: every core; nodes sharing"
            " a machine: cores / nodes)",
        ),
        flag(
            "--ranks",
            type=positive_int,
            help="processes of this node on this host, one per GPU, started as torchrun starts"
            " them (default: one plain process); the node shards its model state over them and"
            " exits as one process would (0 after SIGTERM, 2 if refused)",
        ),
        device_flag(
            "the",
            "auto; or SPARSELOCO_NODE_DEVICE",
            on_cpu="θ, the codec and the outer step stay on the CPU in a plain process, and go"
            " on each process's device with --ranks (or torchrun), --ranks 1 included",
        ),
        *transfer_limit_flags("this node's", env=True),
    ),
)


def _add_coordinator(sub: argparse._SubParsersAction) -> None:
    # No flags of its own, not even --help: ``main`` hands every argument after the word
    # ``coordinator`` to ``python -m coordinator`` (argparse.REMAINDER would drop leading flags).
    p = sub.add_parser(
        "coordinator",
        help="run the coordinator service, or manage its node tokens (coordinator --help)",
        add_help=False,
    )
    p.set_defaults(func=_cmd_coordinator, forward=[])


def _cmd_coordinator(args: argparse.Namespace) -> int:
    # A separate interpreter image: the node package never imports the coordinator.
    import os

    env = dict(os.environ, SPARSELOCO_PROG="sparseloco coordinator")
    os.execve(sys.executable, [sys.executable, "-m", "coordinator", *args.forward], env)
    return 0  # not reached


def _cmd_store_check(args: argparse.Namespace) -> int:
    # The probes are the coordinator's (its store, its signer): run there, like ``coordinator``.
    import os

    env = dict(os.environ, SPARSELOCO_PROG="sparseloco store check")
    command = [sys.executable, "-m", "coordinator", "check-store", *args.forward]
    os.execve(sys.executable, command, env)
    return 0  # not reached


def _split_store_check(argv: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """``argv`` as (the global flags, what follows ``store check``), or None if it is not a
    ``store check`` command."""
    words = list(argv)
    at = next((i for i, w in enumerate(words) if not w.startswith("-")), len(words))
    if words[at : at + 2] == ["store", "check"]:
        return words[:at], words[at + 2 :]
    return None


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed so a test can pin the flags)."""
    parser = argparse.ArgumentParser(
        prog="sparseloco",
        description="SparseLoCo: communication-efficient LLM pre-training over the internet.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=version_line("sparseloco"))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (UP, NODE):
        command.add_to(sub)
    _add_coordinator(sub)
    for command in (STORE, DOCTOR, EXPORT):
        command.add_to(sub)
    add_data(sub)
    SIMULATE.add_to(sub)
    add_bench(sub)
    return parser


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; what follows ``coordinator`` (or ``store check``) is kept, unparsed, in
    ``args.forward``."""
    parser = build_parser()
    split = _split_store_check(sys.argv[1:] if argv is None else argv)
    if split is not None:
        head, forward = split
        args = parser.parse_args([*head, "store", "--dir", "-"])  # the global flags only
        args.command, args.func, args.forward = "store check", _cmd_store_check, forward
        return args
    args, rest = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed: --ranks repeats it
    if args.command == "coordinator":
        args.forward = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


#: Libraries whose INFO and DEBUG lines are theirs, not the operator's ("Found credentials in
#: environment variables"; at DEBUG, every signed request): only their warnings are shown.
QUIET_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3")


def quiet_libraries() -> None:
    """Our logging setup: the storage libraries' loggers at WARNING and above only."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sparseloco`` console script."""
    args = parse(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    quiet_libraries()
    try:
        return int(args.func(args))
    except SparseLoCoError as exc:
        print(f"sparseloco: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sparseloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
