"""``sparseloco bench ...``: the benchmarks' flags and commands (reported numbers, never
pass/fail).

- ``codec``: payload size, encode and decode+aggregate speed, memory (``codec_bench``);
- ``quality``: SparseLoCo, DiLoCo and DDP at equal tokens (``quality``);
- ``robust``: hostile workers against robust aggregation (``robust_bench``);
- ``round``: where a networked round's time goes (``round_bench``, runs ``up``);
- ``overlap``: utilisation on capped links with and without overlap (``utilisation``);
- ``coordinator``: the coordinator under N simulated nodes (``coordinator_load``);
- ``project``: round time and utilisation projected to 1-70 B parameters (``projection``);
- ``sweep``: SparseLoCo's loss over H and k at equal tokens (``sweep``);
- ``node-work``: the node's own work per round and rank, memory per rank (``node_work``);
- ``speed``: the node's training speed round by round beside ``simulate``'s (``speed``);
- ``wan``: round time and utilisation across the WAN lab beside the projection (``wan``).

Each module is imported only when its command runs, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse

from node.research.bench import node_work_flags


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (reported numbers, never pass/fail)")
    bench = p.add_subparsers(
        dest="bench",
        required=True,
        metavar="{codec,quality,robust,round,overlap,coordinator,project,sweep,node-work,speed,wan}",
    )
    c = bench.add_parser("codec", help="payload size, encode and decode+aggregate speed, memory")
    c.add_argument("--preset", default="base", help="model whose shapes are encoded")
    c.add_argument("--peers", type=int, default=16)
    c.add_argument("--repeat", type=int, default=3)
    c.add_argument("--threads", type=int, help="torch threads for the timings (default: all)")
    c.add_argument("--json", dest="json_out", metavar="OUT")
    c.set_defaults(func=_cmd_bench_codec)
    q = bench.add_parser("quality", help="SparseLoCo vs DiLoCo vs DDP on the bench preset")
    q.add_argument("--preset", default="bench")
    q.add_argument("--rounds", type=int)
    q.add_argument("--data")
    q.add_argument("--algos", default="sparseloco,diloco,ddp")
    q.add_argument("--out", default="bench-out/quality", help="folder for JSON and the plot")
    q.set_defaults(func=_cmd_bench_quality)
    b = bench.add_parser("robust", help="hostile workers against robust aggregation (simulated)")
    b.add_argument("--preset", default="tiny")
    b.add_argument("--workers", type=int, default=4)
    b.add_argument("--attackers", type=int, default=1)
    b.add_argument("--rounds", type=int, default=8)
    b.add_argument("--json", dest="json_out", metavar="OUT")
    b.set_defaults(func=_cmd_bench_robust)
    r = bench.add_parser("round", help="time of a networked round, phase by phase (runs up)")
    r.add_argument("--nodes", type=int, default=4)
    r.add_argument("--rounds", type=int, default=8)
    r.add_argument("--preset", default="tiny")
    r.add_argument("--dir", dest="run_dir", help="run folder (default: runs/up-<time>)")
    r.add_argument("--json", dest="json_out", metavar="OUT")
    r.set_defaults(func=_cmd_bench_round)
    o = bench.add_parser(
        "overlap", help="utilisation on capped links, plain and overlapped (runs up 3 times)"
    )
    o.add_argument("--nodes", type=int, default=3)
    o.add_argument("--rounds", type=int, default=6)
    o.add_argument("--preset", default="small")
    o.add_argument(
        "--link-share",
        type=float,
        default=1.0,
        help="a round's transfers take this times its training on the capped links",
    )
    o.add_argument(
        "--variant",
        default="merge",
        help="overlap schedules to run after plain, comma-separated: delayed, eager, merge,"
        " merge:TAU (merge at inner step TAU); default merge at the run's default τ",
    )
    o.add_argument("--dir", dest="run_dir", help="keep the three runs' folders here")
    o.add_argument("--json", dest="json_out", metavar="OUT")
    o.set_defaults(func=_cmd_bench_overlap)
    k = bench.add_parser(
        "coordinator", help="the real coordinator under N simulated nodes doing full rounds"
    )
    k.add_argument("--nodes", type=int, default=1000)
    k.add_argument("--rounds", type=int, default=3)
    k.add_argument("--train-s", type=float, default=2.0, help="every node's simulated training")
    k.add_argument("--spread-s", type=float, default=5.0, help="plus up to this, at random")
    k.add_argument("--apply-s", type=float, default=1.0, help="manifest to report, x0.5-1.5")
    k.add_argument("--join-s", type=float, default=20.0, help="joins spread over this long")
    k.add_argument("--payload-bytes", type=int, default=4096)
    k.add_argument("--timeout-s", type=float, default=900.0, help="then stop, unfinished")
    k.add_argument("--dir", dest="run_dir", help="keep the store, database and logs here")
    k.add_argument("--json", dest="json_out", metavar="OUT")
    k.set_defaults(func=_cmd_bench_coordinator)
    from node.research.bench.projection_report import add_flags

    j = bench.add_parser("project", help="round time and utilisation at 1-70 B, projected")
    add_flags(j).set_defaults(func=_cmd_bench_project)
    from node.research.bench import sweep

    w = bench.add_parser("sweep", help="SparseLoCo's loss over H and k at equal tokens")
    sweep.add_flags(w).set_defaults(func=_cmd_bench_sweep)
    n = bench.add_parser(
        "node-work", help="the node's own work per round and rank, memory per rank (1, 2, 4 ranks)"
    )
    node_work_flags.add_flags(n).set_defaults(func=_cmd_bench_node_work)
    v = bench.add_parser(
        "speed", help="the node's tokens/s round by round beside simulate's (runs up, simulate)"
    )
    v.add_argument("--preset", default="llama_bpe")
    v.add_argument(
        "--data", help="a prepared dataset folder (default: the bundled corpus, prepared first)"
    )
    v.add_argument("--nodes", type=int, default=2)
    v.add_argument("--rounds", type=int, default=4)
    v.add_argument("--threads", type=int, default=1, help="torch threads per node and simulate")
    v.add_argument("--numba-threads", type=int, help="the nodes' numba pool (default: every core)")
    v.add_argument("--dir", dest="run_dir", help="run folder (default: runs/speed-<time>)")
    v.add_argument("--json", dest="json_out", metavar="OUT")
    v.set_defaults(func=_cmd_bench_speed)
    wan = bench.add_parser(
        "wan",
        help="round time and utilisation across the emulated WAN (root: network namespaces),"
        " plain and overlapped, beside bench project's prediction for the same link",
    )
    wan.add_argument(
        "--profiles",
        default="lan,home,office,far,flaky,flaky@5",
        help="link profiles, every node on the same one (lan: the lab without delay;"
        " NAME@S: that profile with a reset about every S seconds)",
    )
    wan.add_argument("--models", default="small,base", help="small (0.44 M), base (10.8 M)")
    wan.add_argument("--schedules", default="plain,overlap", help="plain, overlap (eager)")
    wan.add_argument("--nodes", type=int, default=3)
    wan.add_argument("--rounds", type=int, default=8, help="steady rounds are 2 .. R-2")
    wan.add_argument("--dir", dest="run_dir", help="run folders (default: runs/bench-wan)")
    wan.add_argument("--json", dest="json_out", metavar="OUT")
    wan.add_argument(
        "--from",
        dest="from_json",
        metavar="REPORT",
        help="run nothing: compare a saved --json report's runs with the projection again",
    )
    wan.set_defaults(func=_cmd_bench_wan)


def _cmd_bench_codec(args: argparse.Namespace) -> int:
    from node.research.bench.codec_bench import run

    run(args.json_out, args.preset, args.peers, args.repeat, threads=args.threads)
    return 0


def _cmd_bench_quality(args: argparse.Namespace) -> int:
    from node.research.bench.quality import run_quality

    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    run_quality(args.out, preset=args.preset, algos=algos, rounds=args.rounds, data=args.data)
    return 0


def _cmd_bench_overlap(args: argparse.Namespace) -> int:
    from node.research.bench.utilisation import run

    run(
        args.json_out,
        nodes=args.nodes,
        rounds=args.rounds,
        preset=args.preset,
        run_dir=args.run_dir,
        link_share=args.link_share,
        overlap=args.variant,
    )
    return 0


def _cmd_bench_robust(args: argparse.Namespace) -> int:
    from node.research.bench.robust_bench import run_bench

    run_bench(args.preset, args.workers, args.attackers, args.rounds, args.json_out)
    return 0


def _cmd_bench_round(args: argparse.Namespace) -> int:
    from node.research.bench.round_bench import run

    run(
        args.json_out,
        nodes=args.nodes,
        rounds=args.rounds,
        preset=args.preset,
        run_dir=args.run_dir,
    )
    return 0


def _cmd_bench_coordinator(args: argparse.Namespace) -> int:
    from node.research.bench.coordinator_load import run

    run(
        args.json_out,
        nodes=args.nodes,
        rounds=args.rounds,
        train_s=args.train_s,
        spread_s=args.spread_s,
        join_s=args.join_s,
        apply_s=args.apply_s,
        payload_bytes=args.payload_bytes,
        timeout_s=args.timeout_s,
        root=args.run_dir,
    )
    return 0


def _cmd_bench_project(args: argparse.Namespace) -> int:
    from node.research.bench.projection_report import run

    return run(args)


def _cmd_bench_node_work(args: argparse.Namespace) -> int:
    from node.research.bench.node_work import run_args

    return run_args(args)


def _cmd_bench_speed(args: argparse.Namespace) -> int:
    from node.research.bench.speed import run

    run(
        args.json_out,
        preset=args.preset,
        data=args.data,
        nodes=args.nodes,
        rounds=args.rounds,
        threads=args.threads,
        numba_threads=args.numba_threads,
        run_dir=args.run_dir,
    )
    return 0


def _cmd_bench_sweep(args: argparse.Namespace) -> int:
    from node.research.bench.sweep import run

    return run(args)


def _cmd_bench_wan(args: argparse.Namespace) -> int:
    from node.research.bench.wan import again, run

    if args.from_json:
        again(args.from_json, args.json_out)
        return 0

    def words(text: str) -> list[str]:
        return [w.strip() for w in text.split(",") if w.strip()]

    run(
        args.json_out,
        profile_names=words(args.profiles),
        models=words(args.models),
        schedules=words(args.schedules),
        nodes=args.nodes,
        rounds=args.rounds,
        run_dir=args.run_dir,
    )
    return 0
