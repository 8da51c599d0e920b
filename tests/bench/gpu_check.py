"""GPU check: the device codec bit for bit against the CPU's, then GPU nodes beside a CPU node.

    python tests/bench/gpu_check.py [--preset base] [--peers 8] [--repeat 3] [--no-nodes]
        [--model llama_1b] [--gpu-nodes 2] [--cpu-nodes 1] [--rounds 3] [--inner-steps 2]
    python tests/bench/gpu_check.py --smoke    # the whole script on the CPU, in seconds

Encodes ``--peers`` seeded error-feedback-like buffers of the preset's shapes on the CPU
(``protocol.codec``) and on the GPU (``node.compute.device``) and requires identical payload
bytes and reconstructions; decodes every payload on the GPU and requires the CPU's dense
tensors; aggregates them into the same parameters on both (clipping on, alpha 0.7, plain and
robust) and requires bit-identical results. Then prints the time of each operation on both,
best of ``--repeat``.

Then, unless ``--no-nodes``, ``gpu_nodes.py``: a real run (SeaweedFS, a coordinator, node
processes) of ``--gpu-nodes`` nodes on the GPU and ``--cpu-nodes`` on the CPU, which must agree
on θ's fingerprint after every round, with each node's tokens/s and MFU; then (unless
``--no-ranked``) a second run of sharded nodes: a torchrun node of one process on the GPU,
whose θ, error buffer, codec and aggregation live on the device, beside a torchrun node of
``--cpu-ranks`` processes on the CPU (FSDP over gloo, the outer state sharded over them), which
must agree as well; its table has each node's speed and the reports' phase timings. The
summary of all of it goes to ``$OUT/gpu_check.json`` when ``OUT`` is set (and to ``--json``).

Exits 0 when everything matched, 1 on any difference, and 0 with a "no CUDA device" line
(checking nothing) where torch sees no GPU. ``--smoke`` runs all of it on the CPU: the codec on
the ``tiny`` shapes and the nodes on ``llama_tiny`` (the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gpu_nodes  # this folder's (the script's directory is on sys.path)
import torch

from node.compute import device
from node.compute.outer import AggregateOptions, apply_aggregate
from node.research.bench.codec_bench import error_buffer, model_shapes
from protocol.codec import decode, encode, read_payload


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _best(fn: Callable[[], object], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.int32), b.cpu().view(torch.int32))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="base")
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script itself")
    ap.add_argument("--no-nodes", dest="nodes", action="store_false", help="the codec only")
    ap.add_argument("--json", dest="json_out", help="write the summary here too")
    gpu_nodes.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.preset, args.peers, args.repeat = "cpu", "tiny", 2, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; nothing checked (run it on a GPU box)")
        return 0
    summary: dict[str, object] = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    codec = codec_check(args)
    summary["codec"] = codec
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the nodes are other processes on the same GPU
    nodes = gpu_nodes.run_nodes(args) if args.nodes else {"ok": True, "skipped": True}
    summary["nodes"] = nodes
    ranked = (
        gpu_nodes.run_ranked(args) if args.nodes and args.ranked else {"ok": True, "skipped": True}
    )
    summary["ranked"] = ranked
    ok = bool(codec["ok"] and nodes["ok"] and ranked["ok"])
    summary["ok"] = ok
    text = json.dumps(summary, indent=2) + "\n"
    for path in [
        *([Path(os.environ["OUT"]) / "gpu_check.json"] if os.environ.get("OUT") else []),
        *([Path(args.json_out)] if args.json_out else []),
    ]:
        path.write_text(text, encoding="utf-8")
        print(f"gpu_check: wrote {path}")
    print(f"gpu_check: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def codec_check(args: argparse.Namespace) -> dict[str, object]:
    """The device codec and aggregation against the CPU's, bit for bit, and their timings."""
    cuda = torch.device(args.device)
    shapes = model_shapes(args.preset)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    name = torch.cuda.get_device_name(0) if cuda.type == "cuda" else "CPU (dry run)"
    print(
        f"gpu_check: {name}, torch {torch.__version__}, "
        f"preset {args.preset} ({params / 1e6:.1f} M parameters), {args.peers} peers"
    )
    failures = []
    datas = {}
    for i in range(args.peers):
        x = error_buffer(shapes, 100 + i)
        data, recon = encode(x)
        gdata, grecon = device.encode({n: v.to(cuda) for n, v in x.items()})
        if gdata != data:
            failures.append(f"peer {i}: payload bytes differ")
        if not all(_same(grecon[n], recon[n]) for n in shapes):
            failures.append(f"peer {i}: reconstruction differs")
        datas[f"node-{i:03d}"] = data
    lazy = {k: read_payload(d, shapes, lazy=True) for k, d in datas.items()}
    first = next(iter(datas.values()))
    dense = decode(first, shapes)
    gdense = device.decode(lazy[next(iter(datas))], cuda)
    if not all(_same(gdense[n], dense[n]) for n in shapes):
        failures.append("decode differs")
    start = {
        n: torch.randn(s, generator=torch.Generator().manual_seed(1)) for n, s in shapes.items()
    }
    for robust in (False, True):
        cpu = {n: v.clone() for n, v in start.items()}
        gpu = {n: v.to(cuda) for n, v in start.items()}
        want = apply_aggregate(cpu, lazy, AggregateOptions(alpha=0.7, robust=robust))
        got = device.apply_aggregate(gpu, lazy, AggregateOptions(alpha=0.7, robust=robust))
        if got.rejected != want.rejected or not all(_same(gpu[n], cpu[n]) for n in shapes):
            failures.append(f"aggregation (robust={robust}) differs")
    x = error_buffer(shapes, 0)
    gx = {n: v.to(cuda) for n, v in x.items()}
    gparams = {n: v.to(cuda) for n, v in start.items()}
    cparams = {n: v.clone() for n, v in start.items()}
    rows = [
        (
            "encode",
            _best(lambda: encode(x), args.repeat),
            _best(lambda: device.encode(gx), args.repeat),
        ),
        (
            f"aggregate {args.peers} peers (lazy read + apply)",
            _best(
                lambda: apply_aggregate(
                    cparams, {k: read_payload(d, shapes, lazy=True) for k, d in datas.items()}
                ),
                args.repeat,
            ),
            _best(
                lambda: device.apply_aggregate(
                    gparams, {k: read_payload(d, shapes, lazy=True) for k, d in datas.items()}
                ),
                args.repeat,
            ),
        ),
    ]
    print("| operation | CPU (numba) | GPU (torch) |\n|---|---:|---:|")
    for op, c, g in rows:
        print(f"| {op} | {c * 1e3:.1f} ms | {g * 1e3:.1f} ms |")
    peak = torch.cuda.max_memory_allocated() if cuda.type == "cuda" else None
    if peak is not None:
        print(f"peak GPU memory: {peak / 1e6:.0f} MB")
    if failures:
        print("gpu_check: codec FAILED\n  " + "\n  ".join(failures))
    else:
        print(f"gpu_check: codec OK, bit-identical on {cuda.type}")
    return {
        "ok": not failures,
        "failures": failures,
        "preset": args.preset,
        "parameters": params,
        "peers": args.peers,
        "seconds": {op: {"cpu": c, "device": g} for op, c, g in rows},
        "peak_device_memory": peak,
    }


if __name__ == "__main__":
    sys.exit(main())
