"""GPU check: the device codec bit for bit against the CPU's, then GPU nodes beside a CPU node.

    python tests/bench/gpu_check.py [--preset base] [--peers 8] [--repeat 3] [--no-nodes]
        [--model llama_1b] [--gpu-nodes 2] [--cpu-nodes 1] [--rounds 3] [--inner-steps 2]
        [--moe-model llama_moe_645m] [--moe-batch 8] [--moe-seq 1024]
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
``--no-ranked``) a second run of sharded nodes: a node of one process under ``--ranks 1`` on
the GPU, whose θ, error buffer, codec and aggregation live on the device, beside a node of
``--cpu-ranks`` processes on the CPU (FSDP over gloo, the outer state sharded over them), which
must agree as well; its table has each node's speed and the reports' phase timings. The
summary of all of it goes to ``$OUT/gpu_check.json`` when ``OUT`` is set (and to ``--json``).

Then the mixture of experts at the paper's shape (``--moe-model``, 645M-A273M class): a few
inner steps on the GPU in bf16 autocast (loss finite and falling, seconds a step, tokens/s, MFU
counted on the active parameters, peak memory), the codec's payload of its real pseudo-gradient
encoded on the GPU and on the CPU byte for byte, and the model's export to Mixtral loading in
``transformers`` with our logits (fp32, ≤ 1e-4).

Exits 0 when everything matched, 1 on any difference, and 0 with a "no CUDA device" line
(checking nothing) where torch sees no GPU. ``--smoke`` runs all of it on the CPU: the codec on
the ``tiny`` shapes, the nodes on ``llama_tiny`` and the mixture of experts on ``llama_moe``
(the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import math
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
    ap.add_argument("--moe-model", default="llama_moe_645m", help="the mixture of experts")
    ap.add_argument("--moe-batch", type=int, default=8)
    ap.add_argument("--moe-seq", type=int, default=1024)
    ap.add_argument("--no-moe", dest="moe", action="store_false", help="skip the MoE step")
    gpu_nodes.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.preset, args.peers, args.repeat = "cpu", "tiny", 2, 1
        args.moe_model, args.moe_batch, args.moe_seq = "llama_moe", 2, 64
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
    moe = moe_check(args) if args.moe else {"ok": True, "skipped": True}
    summary["moe"] = moe
    ok = bool(codec["ok"] and nodes["ok"] and ranked["ok"] and moe["ok"])
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


def moe_check(args: argparse.Namespace) -> dict[str, object]:
    """The mixture of experts on the device: inner steps, the codec on its pseudo-gradient, the
    export to Mixtral (module docstring)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from node.compute.model import autocast, build_model, get_preset, param_count
    from node.compute.throughput import flops_per_token, peak_flops
    from node.tools.hf import write_hf

    cfg = get_preset(args.moe_model)
    dev = torch.device(args.device)
    model = build_model(cfg, seed=0).to(dev)
    start = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(0)
    seq = min(args.moe_seq, cfg.ctx_len)
    tokens = torch.randint(0, cfg.vocab_size, (args.moe_batch, seq + 1), generator=gen).to(dev)
    model.train()
    losses, times = [], []
    for _ in range(4):
        _sync()
        t0 = time.perf_counter()
        with autocast(dev):
            loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    step_s = min(times[1:])
    tokens_per_s = args.moe_batch * seq / step_s
    peak = peak_flops(dev) if dev.type == "cuda" else None
    delta = {n: start[n] - p.detach().to("cpu") for n, p in model.named_parameters()}
    cpu_bytes, _ = encode(delta, topk=64, tile=64, node_id="moe")
    dev_bytes, _ = device.encode(
        {n: t.to(dev) for n, t in delta.items()}, topk=64, tile=64, node_id="moe"
    )
    model = model.float().to("cpu").eval()
    with tempfile.TemporaryDirectory() as folder:
        write_hf({n: p.data for n, p in model.named_parameters()}, cfg, Path(folder), {})
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ids = tokens[:1, :64].to("cpu")
        with torch.no_grad():
            logit_diff = (theirs(ids).logits - model(ids)).abs().max().item()
    result: dict[str, object] = {
        "model": args.moe_model,
        "parameters": param_count(cfg),
        "active": param_count(cfg, active=True),
        "losses": losses,
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": None if peak is None else tokens_per_s * flops_per_token(cfg) / peak,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30
        if dev.type == "cuda"
        else None,
        "payload_bytes": len(cpu_bytes),
        "payload_identical": cpu_bytes == dev_bytes,
        "export_max_logit_diff": logit_diff,
    }
    finite = all(map(math.isfinite, losses))
    result["ok"] = bool(finite and cpu_bytes == dev_bytes and logit_diff <= 1e-4)
    print(
        f"moe {args.moe_model}: {param_count(cfg) / 1e6:.0f} M ({result['active']} active),"
        f" {step_s:.3f} s a step, {tokens_per_s:,.0f} tokens/s, losses {losses},"
        f" payload {'identical' if cpu_bytes == dev_bytes else 'DIFFERENT'},"
        f" export logits within {logit_diff:.1e}"
    )
    return result


if __name__ == "__main__":
    sys.exit(main())
