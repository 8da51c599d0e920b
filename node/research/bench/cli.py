"""``sparseloco bench ...``: one table of the benchmarks, their flags and what each runs
(reported numbers, never pass/fail).

- ``codec``: payload size, encode and decode+aggregate speed, memory (``codec_bench``);
- ``quality``: SparseLoCo, DiLoCo and DDP at equal tokens (``quality``);
- ``robust``: hostile workers against robust aggregation (``robust_bench``);
- ``round``: where a networked round's time goes (``round_bench``, runs ``up``);
- ``overlap``: utilisation on capped links with and without overlap (``utilisation``);
- ``coordinator``: the coordinator under N simulated nodes (``coordinator_load``);
- ``project``: round time and utilisation projected to 1-70 B parameters (``projection_report``);
- ``sweep``: SparseLoCo's loss over H and k at equal tokens (``sweep``);
- ``node-work``: the node's own work per round and rank, memory per rank (``node_work``);
- ``speed``: the node's training speed round by round beside ``simulate``'s (``speed``);
- ``wan``: round time and utilisation across the WAN lab beside the projection (``wan``);
- ``unequal``: unequal workers at equal wall time: wait, leave out, budget, batch (``unequal``);
- ``straggler``: one node of a real run slowed, the budget off and on: what the others keep
  (``straggler``, runs ``up`` twice);
- ``up``: how long ``sparseloco up`` takes as typed, phase by phase, with the load (``up_time``).

A bench is one ``Bench`` row: its flags as data, and the function that runs it, called with one
keyword per flag, or one value for flags that belong together (``Gather``: the ``up`` runs of
``round`` and ``overlap``). Adding a bench is adding a row (and its module); the module prints
its table and writes its ``--json`` report with ``node.research.report.publish``. Each module is
imported only when its command runs, so ``--help`` stays fast and never loads torch.
"""

from __future__ import annotations

import argparse
import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from node.subcommand import Flag, add_flags, flag


def number(name: str, default: int | None = None, help: str | None = None) -> Flag:
    """An integer flag (``help`` only when given, as argparse shows it)."""
    return flag(name, type=int, default=default, **({"help": help} if help else {}))


def json_out(help: str | None = None) -> Flag:
    """``--json OUT``: where the bench writes its whole report."""
    return flag("--json", dest="json_out", metavar="OUT", **({"help": help} if help else {}))


def run_dir(help: str) -> Flag:
    """``--dir``: where the bench keeps the folders of the runs it starts."""
    return flag("--dir", dest="run_dir", help=help)


def words(text: str) -> list[str]:
    """A comma-separated flag value as its words."""
    return [w.strip() for w in text.split(",") if w.strip()]


def ints(text: str) -> list[int]:
    """A comma-separated flag value as integers."""
    return [int(w) for w in words(text)]


def load(target: str) -> Any:
    """``module:name``, the module imported now."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Gather:
    """Flags a bench takes as one value: its keyword ``keyword`` is ``target`` (``module:name``)
    called with the values of the flags ``dests``, by dest."""

    keyword: str
    target: str
    dests: tuple[str, ...]


#: ``--nodes``, ``--rounds``, ``--preset`` and ``--dir`` of a bench that starts ``up`` runs, as
#: its keyword ``runs``: the ``UpConfig`` its runs start from (``round_bench.one_run``).
UP_RUNS = Gather("runs", "node.cluster.up:UpConfig", ("nodes", "rounds", "preset", "run_dir"))


@dataclass(frozen=True)
class Bench:
    """One ``sparseloco bench`` command.

    ``target`` is ``module:function`` in ``node.research.bench``; the function gets one keyword
    per flag (its ``dest``, or the name ``rename`` gives it), after ``convert`` has parsed the
    values that are lists, except the flags of a ``gather``, which come as one value. Its return
    value is the report: the command's status is 0.
    """

    name: str
    help: str
    target: str
    flags: tuple[Flag, ...]
    rename: Mapping[str, str] = field(default_factory=dict)
    convert: Mapping[str, Callable[[str], Any]] = field(default_factory=dict)
    gather: tuple[Gather, ...] = ()

    def add_to(self, p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the flags to ``p``; running the command runs the bench."""
        p.set_defaults(func=functools.partial(self.run, add_flags(p, self.flags)))
        return p

    def run(self, dests: Sequence[str], args: argparse.Namespace) -> int:
        options = {}
        for dest in dests:
            value = getattr(args, dest)
            if value is not None and dest in self.convert:
                value = self.convert[dest](value)
            options[self.rename.get(dest, dest)] = value
        for g in self.gather:
            options[g.keyword] = load(g.target)(**{dest: options.pop(dest) for dest in g.dests})
        load(f"node.research.bench.{self.target}")(**options)
        return 0


CODEC_FLAGS = (
    flag("--preset", default="base", help="model whose shapes are encoded"),
    number("--peers", 16),
    number("--repeat", 3),
    number("--threads", help="torch threads for the timings (default: all)"),
    json_out(),
)

QUALITY_FLAGS = (
    flag("--preset", default="bench"),
    number("--rounds"),
    flag("--data"),
    flag("--algos", default="sparseloco,diloco,ddp"),
    flag("--out", default="bench-out/quality", help="folder for JSON and the plot"),
)

ROBUST_FLAGS = (
    flag("--preset", default="tiny"),
    number("--workers", 4),
    number("--attackers", 1),
    number("--rounds", 8),
    json_out(),
)

ROUND_FLAGS = (
    number("--nodes", 4),
    number("--rounds", 8),
    flag("--preset", default="tiny"),
    run_dir("run folder (default: runs/up-<time>)"),
    json_out(),
)

OVERLAP_FLAGS = (
    number("--nodes", 3),
    number("--rounds", 6),
    flag("--preset", default="small"),
    flag(
        "--link-share",
        type=float,
        default=1.0,
        help="a round's transfers take this times its training on the capped links",
    ),
    flag(
        "--variant",
        default="merge",
        help="overlap schedules to run after plain, comma-separated: delayed, eager,"
        " merge, merge:TAU (merge at inner step TAU); default merge at the run's"
        " default τ",
    ),
    run_dir("keep the three runs' folders here"),
    json_out(),
)

COORDINATOR_FLAGS = (
    number("--nodes", 1000),
    number("--rounds", 3),
    flag("--train-s", type=float, default=2.0, help="every node's simulated training"),
    flag("--spread-s", type=float, default=5.0, help="plus up to this, at random"),
    flag("--apply-s", type=float, default=1.0, help="manifest to report, x0.5-1.5"),
    flag("--join-s", type=float, default=20.0, help="joins spread over this long"),
    number("--payload-bytes", 4096),
    flag("--timeout-s", type=float, default=900.0, help="then stop, unfinished"),
    run_dir("keep the store, database and logs here"),
    json_out(),
)

PROJECT_FLAGS = (
    flag("--sizes", help="parameter counts, comma-separated: 1B,8B,70B or 1e9,..."),
    flag("--links", help="link rates in Mbit/s, comma-separated (default 100,1000)"),
    flag(
        "--link",
        dest="lab_links",
        metavar="PROFILES",
        help="WAN lab profiles too, comma-separated: home, office, far, flaky (rates,"
        " RTT, resets; docs/benchmarks.md §17); alone, only those",
    ),
    number("--parallel-downloads", help="a node's parallel GETs (default 8)"),
    flag(
        "--resume-bytes",
        type=float,
        help="bytes a reset makes a transfer send again at most (default: as the node"
        " does, 8 MiB parts from 64 MiB up, smaller objects whole)",
    ),
    flag("--mfu", type=float, help="model FLOPs utilisation (default 0.4)"),
    number("--gpus", help="GPUs per node (default 8)"),
    flag("--peak-tflops", type=float, help="one GPU's peak (default 989, H100 bf16)"),
    number("--tokens-per-step", help="per node (default 262144)"),
    flag("--inner-steps", "-H", type=int, help="H (default 30)"),
    flag("--peers", "-G", type=int, help="G, payloads gathered (default 16)"),
    flag("--bits-per-param", type=float, help="payload size (default 0.1445)"),
    flag("--cpu-work-ns", type=float, help="node work, CPU path (default 28.5)"),
    flag("--device-work-ns", type=float, help="device path (assumed 5.0)"),
    flag(
        "--shard-fixed-ns",
        type=float,
        help="per-rank work that does not shrink with ranks",
    ),
    flag("--shard-scaled-ns", type=float, help="per-rank work divided by the ranks"),
    json_out("write inputs and rows here"),
)

SWEEP_FLAGS = (
    flag("--model", default="llama_bpe4k_1m", help="model preset"),
    flag("--data", help="a folder made by `sparseloco data prepare` (or text)"),
    number("--workers", 2),
    number("--batch-size", 8),
    number("--steps", 180, "inner steps per worker, every point"),
    flag("--hs", default="5,15,45", help="values of H (each must divide --steps)"),
    flag("--topks", default="16,32,64,128", help="values of k per 64x64 tile"),
    flag("--diloco", action="store_true", help="add DiLoCo at each H"),
    number("--seed", 0),
    flag("--out", default="bench-out/sweep", help="folder for sweep.json and the table"),
)

NODE_WORK_FLAGS = (
    flag("--preset", help="model preset (default: the 81 M benchmark shape)"),
    flag("--ranks", default="1,2,4", help="rank counts to measure (default 1,2,4)"),
    number("--rounds", 3),
    number("--peers", 16),
    number("--train-steps", 0, "real inner steps a round (0: none)"),
    number("--batch-size", 4, "the node's batch (>= every ranks)"),
    number("--ctx-len", help="another context length for the model"),
    number("--threads", 1, "torch threads per rank"),
    flag("--state-dir", help="where the state files go (default: a temp dir)"),
    json_out(),
)

SPEED_FLAGS = (
    flag("--preset", default="llama_bpe"),
    flag(
        "--data",
        help="a prepared dataset folder (default: the bundled corpus, prepared first)",
    ),
    number("--nodes", 2),
    number("--rounds", 4),
    number("--threads", 1, "torch threads per node and simulate"),
    number("--numba-threads", help="the nodes' numba pool (default: every core)"),
    run_dir("run folder (default: runs/speed-<time>)"),
    json_out(),
)

WAN_FLAGS = (
    flag(
        "--profiles",
        default="lan,home,office,far,flaky,flaky@5",
        help="link profiles, every node on the same one (lan: the lab without delay;"
        " NAME@S: that profile with a reset about every S seconds)",
    ),
    flag("--models", default="small,base", help="small (0.44 M), base (10.8 M)"),
    flag("--schedules", default="plain,overlap", help="plain, overlap (eager)"),
    number("--nodes", 3),
    number("--rounds", 8, "steady rounds are 2 .. R-2"),
    run_dir("run folders (default: runs/bench-wan)"),
    json_out(),
    flag(
        "--from",
        dest="from_json",
        metavar="REPORT",
        help="run nothing: compare a saved --json report's runs with the projection again",
    ),
)

UNEQUAL_FLAGS = (
    flag("--preset", default="bench", help="run preset (its rounds x H is the wall time)"),
    flag("--model", help="model preset, overriding the run preset's"),
    flag("--data", help="a folder made by `sparseloco data prepare` (or text)"),
    number("--inner-steps", help="H, overriding the preset's"),
    number("--batch-size", help="overriding the preset's"),
    number("--rounds", help="a speed-1 fleet's rounds: the wall time is these x H"),
    flag("--wall", type=float, help="the wall time in step units (default: rounds x H)"),
    flag(
        "--mixes",
        help="speed mixes, ';'-separated, each one speed per worker (default"
        " 1,1,1,0.333;1,0.5,0.333,0.2)",
    ),
    flag(
        "--variants",
        help="runs to make, comma-separated (default all): wait, leave_out, budget, batch,"
        " mean, steps, per_step, fastest",
    ),
    flag("--final-only", action="store_true", help="evaluate only before and after the run"),
    number("--seed"),
    flag("--out", default="bench-out/unequal", help="folder for the runs' JSON and the tables"),
)

STRAGGLER_FLAGS = (
    number("--nodes", 4),
    number("--rounds", 12),
    flag("--preset", default="small"),
    number("--inner-steps", 60, help="H of both runs"),
    flag("--factor", type=float, default=3.0, help="the last node's steps take this much longer"),
    number("--slow-from", 4, help="the round the slowdown starts"),
    flag(
        "--budgets",
        default="off,median",
        help="the [run.timing] budget of each run, in turn: off, median, fastest or seconds",
    ),
    run_dir("keep the runs' folders here"),
    json_out(),
)

#: Every ``sparseloco bench`` command, in the order ``--help`` lists them.
UP_TIME_FLAGS = (
    number("--runs", 3, help="runs one after the other; the first with an empty numba cache"),
    run_dir("folder of the runs (default: runs/bench-up-<time>)"),
    json_out(),
)

BENCHES = (
    Bench(
        "codec",
        "payload size, encode and decode+aggregate speed, memory",
        "codec_bench:run",
        CODEC_FLAGS,
    ),
    Bench(
        "quality",
        "SparseLoCo vs DiLoCo vs DDP on the bench preset",
        "quality:run_quality",
        QUALITY_FLAGS,
        convert={"algos": words},
    ),
    Bench(
        "robust",
        "hostile workers against robust aggregation (simulated)",
        "robust_bench:run_bench",
        ROBUST_FLAGS,
    ),
    Bench(
        "round",
        "time of a networked round, phase by phase (runs up)",
        "round_bench:run",
        ROUND_FLAGS,
        gather=(UP_RUNS,),
    ),
    Bench(
        "overlap",
        "utilisation on capped links, plain and overlapped (runs up 3 times)",
        "utilisation:run",
        OVERLAP_FLAGS,
        rename={"variant": "overlap"},
        gather=(UP_RUNS,),
    ),
    Bench(
        "coordinator",
        "the real coordinator under N simulated nodes doing full rounds",
        "coordinator_load:run",
        COORDINATOR_FLAGS,
        rename={"run_dir": "root"},
    ),
    Bench(
        "project",
        "round time and utilisation at 1-70 B, projected",
        "projection_report:run",
        PROJECT_FLAGS,
    ),
    Bench(
        "sweep",
        "SparseLoCo's loss over H and k at equal tokens",
        "sweep:run_sweep",
        SWEEP_FLAGS,
        convert={"hs": ints, "topks": ints},
    ),
    Bench(
        "node-work",
        "the node's own work per round and rank, memory per rank (1, 2, 4 ranks)",
        "node_work:run",
        NODE_WORK_FLAGS,
        convert={"ranks": ints},
    ),
    Bench(
        "speed",
        "the node's tokens/s round by round beside simulate's (runs up, simulate)",
        "speed:run",
        SPEED_FLAGS,
    ),
    Bench(
        "wan",
        "round time and utilisation across the emulated WAN (root: network namespaces),"
        " plain and overlapped, beside bench project's prediction for the same link",
        "wan:run",
        WAN_FLAGS,
        rename={"profiles": "profile_names"},
        convert={"profiles": words, "models": words, "schedules": words},
    ),
    Bench(
        "unequal",
        "unequal workers at equal wall time: wait, leave out, budget, batch (simulated)",
        "unequal:run",
        UNEQUAL_FLAGS,
        convert={"variants": words},
    ),
    Bench(
        "straggler",
        "one node of a real run slowed to 1/F: the others' training share, budget off and on"
        " (runs up twice)",
        "straggler:run",
        STRAGGLER_FLAGS,
        convert={"budgets": words},
    ),
    Bench(
        "up",
        "how long `sparseloco up` takes as typed, phase by phase, with the load (runs it"
        " --runs times)",
        "up_time:run",
        UP_TIME_FLAGS,
    ),
)


def add_bench(sub: argparse._SubParsersAction) -> None:
    """``sparseloco bench`` and one subcommand per row of ``BENCHES``."""
    p = sub.add_parser("bench", help="benchmarks (reported numbers, never pass/fail)")
    names = ",".join(b.name for b in BENCHES)
    benches = p.add_subparsers(dest="bench", required=True, metavar=f"{{{names}}}")
    for bench in BENCHES:
        bench.add_to(benches.add_parser(bench.name, help=bench.help))


def bench_main(name: str, prog: str, description: str | None, argv: list[str] | None) -> int:
    """One bench as its own script (``python -m node.research.bench.node_work``)."""
    (bench,) = [b for b in BENCHES if b.name == name]
    p = argparse.ArgumentParser(prog=prog, description=description)
    args = bench.add_to(p).parse_args(argv)
    return int(args.func(args))
