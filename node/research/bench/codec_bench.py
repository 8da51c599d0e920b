"""Codec benchmarks for the README: payload size, throughput and aggregation memory.

Everything runs on a *realistic model dict*: the parameter shapes of a ``node.compute.model``
preset, filled like an error-feedback buffer (heavy-tailed Student-t values, df = 3, with a
log-normal scale per row and per tensor), seeded. Measurements are side by side with the
straightforward torch baseline of ``node.research.bench.naive`` in the same process, as ratios
(DESIGN.md, "Performance targets"):

- ``size_report``: bits per parameter of our real payload against the entropy bound
  (``log2 C(tile_len, k)`` per tile + 2 bits per kept value; target ratio <= 1.04) and against
  the production format (12-bit indices + a byte per code; target ratio <= 0.5);
- ``speed_report``: encode (with the reconstruction, into reused buffers as the node does)
  against the baseline and against a memory copy of the same fp32 bytes (target <= 8x the copy;
  encode into fresh buffers is reported beside it), and decode + aggregate + apply of
  ``peers`` payloads (target >= 1.5x the baseline), warm-up then best of ``repeat``, interleaved;
- ``memory_report``: peak RSS growth of decode + aggregate + apply, each in a fresh subprocess
  (``node.research.bench.memory``), in MB and in fp32 model copies (target <= 0.5 on the node's
  lazy path).

``run`` does all three, prints ``format_markdown``'s tables and optionally writes JSON.
"""

from __future__ import annotations

import functools
import gc
import math
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from node.compute.outer import AggregateOptions, apply_aggregate
from node.research.bench import naive
from node.research.bench.codec_tables import format_markdown
from node.research.bench.memory import peak_aggregation_bytes
from node.research.report import publish
from protocol.codec import encode, read_payload
from protocol.tiles import TileGeometry, matrix_shape

Shapes = Mapping[str, tuple[int, ...]]
MB = 1e6

TARGET_BOUND_RATIO = 1.04
TARGET_PRODUCTION_RATIO = 0.5
#: Encode at most this many times a memory copy of the same fp32 bytes (issue 11).
TARGET_ENCODE_MEMCPY = 8.0
#: Decode + aggregate + apply at least this much faster than the production path (issue 11).
TARGET_AGGREGATE_SPEEDUP = 1.5
#: Peak aggregation memory at most this many fp32 model copies (issue 11).
TARGET_MEMORY_COPIES = 0.5


# --------------------------------------------------------------------------- inputs


#: Shape sets for the codec benchmark beyond the model presets. ``81m``: d_model 768, 8 layers
#: and a 32,768-token embedding (82.6 M parameters, the largest tensor 25 M): the size benchmark
#: 3 of issue 11 is measured at, with a large embedding, the hard case for aggregation scratch.
BENCH_MODELS = {
    "81m": {"d_model": 768, "n_layers": 8, "n_heads": 12, "ctx_len": 1024, "vocab_size": 32768}
}


def model_shapes(preset_or_shapes: str | Shapes) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a ``node.compute.model`` preset or a ``BENCH_MODELS`` entry (built on
    the meta device), or ``shapes``."""
    if not isinstance(preset_or_shapes, str):
        return {n: tuple(s) for n, s in preset_or_shapes.items()}
    from node.compute.model import ModelConfig, get_preset, model_class

    if preset_or_shapes in BENCH_MODELS:
        cfg = ModelConfig(**BENCH_MODELS[preset_or_shapes])
    else:
        cfg = get_preset(preset_or_shapes)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def error_buffer(shapes: Shapes, seed: int, row_sigma: float = 0.5) -> dict[str, torch.Tensor]:
    """A seeded stand-in for an error-feedback buffer: Student-t (df = 3) with per-row scales.

    Each row is scaled by ``exp(row_sigma * N(0, 1))``; ``row_sigma = 0`` gives i.i.d. values,
    whose Top-k positions are uniformly random subsets (the case the entropy bound describes).
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        rows, cols = matrix_shape(shape)
        n = rows * cols
        chi2 = torch.randn(3, n, generator=gen).square_().sum(0).div_(3.0)
        t = torch.randn(n, generator=gen).div_(chi2.sqrt_())
        row_scale = torch.randn(rows, 1, generator=gen).mul_(row_sigma).exp_()
        tensor_scale = 1e-3 * math.exp(0.5 * float(torch.randn((), generator=gen)))
        out[name] = t.view(rows, cols).mul_(row_scale).mul_(tensor_scale).view(shape)
    return out


@functools.lru_cache(maxsize=2)
def _payloads(
    key: tuple[tuple[str, tuple[int, ...]], ...], peers: int, topk: int, tile: int, seed: int
) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """Ours and the baseline's payloads of ``peers`` distinct error buffers (cached)."""
    shapes = dict(key)
    ours, theirs = [], []
    for i in range(peers):
        x = error_buffer(shapes, seed + 1 + i)
        ours.append(encode(x, topk=topk, tile=tile)[0])
        theirs.append(naive.encode(x, topk=topk, tile_size=tile)[0])
    return tuple(ours), tuple(theirs)


@dataclass(frozen=True)
class CodecCase:
    """What the speed and memory reports measure: ``peers`` payloads of distinct error buffers
    (seeded from ``seed``), top-``topk`` of each ``tile``, aggregated with or without ``clip``."""

    peers: int = 16
    topk: int = 64
    seed: int = 0
    tile: int = 64
    clip: bool = True

    def payloads(self, shapes: Shapes) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """Ours and the baseline's payloads of the peers (cached)."""
        key = tuple(sorted(shapes.items()))
        return _payloads(key, self.peers, self.topk, self.tile, self.seed)


def _numel(shapes: Shapes) -> int:
    return sum(math.prod(s) for s in shapes.values())


# --------------------------------------------------------------------------- size


def bound_bits(geometry: TileGeometry) -> float:
    """Entropy bound of one tensor: ``n_tiles * log2 C(tile_len, k) + 2 * n_kept`` bits."""
    n, k = geometry.tile_len, geometry.k
    log2_choose = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
    return geometry.n_tiles * log2_choose + 2 * geometry.n_kept


def size_report(
    preset_or_shapes: str | Shapes, ks: tuple[int, ...] = (64, 128), seed: int = 0, tile: int = 64
) -> dict[str, Any]:
    """Bits per parameter of our payload, the entropy bound and the production format, per k.

    Measured on the error-feedback-like input and, for reference, on i.i.d. Student-t values
    (uniformly random positions: there the bound is a true lower bound for position coding).
    """
    shapes = model_shapes(preset_or_shapes)
    params = _numel(shapes)
    rows = []
    for label, row_sigma in (("EF-like", 0.5), ("i.i.d.", 0.0)):
        x = error_buffer(shapes, seed, row_sigma)
        rows += _size_rows(x, shapes, ks, tile, label)
    return {"params": params, "tensors": len(shapes), "rows": rows}


def _size_rows(
    x: Mapping[str, torch.Tensor], shapes: Shapes, ks: tuple[int, ...], tile: int, label: str
) -> list[dict[str, Any]]:
    params = _numel(shapes)
    rows = []
    for k in ks:
        ours = len(encode(x, topk=k, tile=tile)[0]) * 8
        production = len(naive.encode(x, topk=k, tile_size=tile)[0]) * 8
        geos = [TileGeometry.of(s, topk=k, tile=tile) for s in shapes.values()]
        bound = sum(bound_bits(g) for g in geos)
        rows.append(
            {
                "input": label,
                "k": k,
                "kept": sum(g.n_kept for g in geos),
                "ours_bytes": ours // 8,
                "ours_bpp": ours / params,
                "bound_bpp": bound / params,
                "production_bpp": production / params,
                "ratio_to_bound": ours / bound,
                "ratio_to_production": ours / production,
                "ok": ours / bound <= TARGET_BOUND_RATIO
                and ours / production <= TARGET_PRODUCTION_RATIO,
            }
        )
    return rows


# --------------------------------------------------------------------------- speed


def _best_of(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Warm each function up once, then the best of ``repeat`` timed calls, interleaved."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, math.inf)
    for _ in range(repeat):
        for name, fn in fns.items():
            gc.collect()
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def speed_report(
    preset_or_shapes: str | Shapes,
    case: CodecCase = CodecCase(),
    repeat: int = 3,
    threads: int | None = None,
) -> dict[str, Any]:
    """Encode and decode + aggregate + apply times, ours against the baseline, best of
    ``repeat``.

    ``threads`` sets torch's intra-op threads for the measurement (default: as configured).
    """
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _speed(model_shapes(preset_or_shapes), case, repeat)
    finally:
        torch.set_num_threads(saved)


def _speed(shapes: Shapes, case: CodecCase, repeat: int) -> dict[str, Any]:
    peers, topk, tile, clip = case.peers, case.topk, case.tile, case.clip
    model_mb = _numel(shapes) * 4 / MB
    x = error_buffer(shapes, case.seed)
    copies = {n: torch.empty_like(v) for n, v in x.items()}

    def memcpy() -> None:
        for n, v in x.items():
            copies[n].copy_(v)

    # The node writes each round's reconstruction into the buffers of a settled round's
    # (``Worker.forget``), as a copy writes into existing tensors: "ours" does the same, and
    # "fresh" allocates new ones (first-touch page faults included), as a one-off call does.
    recon = encode(x, topk=topk, tile=tile)[1]
    enc = _best_of(
        {
            "ours": lambda: encode(x, topk=topk, tile=tile, out=recon),
            "fresh": lambda: encode(x, topk=topk, tile=tile),
            "naive": lambda: naive.encode(x, topk=topk, tile_size=tile),
            "memcpy": memcpy,
        },
        repeat,
    )
    ours_data, naive_data = case.payloads(shapes)
    params = {n: torch.zeros(s) for n, s in shapes.items()}

    def ours_aggregate(lazy: bool) -> None:
        payloads = {
            f"peer{i:03d}": read_payload(d, shapes, topk=topk, tile=tile, lazy=lazy)
            for i, d in enumerate(ours_data)
        }
        apply_aggregate(params, payloads, AggregateOptions(clip=clip))

    def naive_aggregate() -> None:
        naive.apply(params, naive_data, topk=topk, tile_size=tile, clip=clip)

    agg = _best_of(
        {
            "ours": lambda: ours_aggregate(False),
            "lazy": lambda: ours_aggregate(True),
            "naive": naive_aggregate,
        },
        repeat,
    )
    # The node reads payloads lazily (checked completely first, each tensor decoded once while
    # aggregating, so memory holds one decoded tensor per peer): that is its real path.
    lazy = {"ours": agg["lazy"], "naive": agg["naive"]}
    rows = []
    for op, times, target in (
        ("encode (incl. reconstruction)", enc, None),
        (f"decode + aggregate ({peers} peers)", agg, TARGET_AGGREGATE_SPEEDUP),
        (
            f"the node's path: lazy decode + aggregate ({peers} peers)",
            lazy,
            TARGET_AGGREGATE_SPEEDUP,
        ),
    ):
        speedup = times["naive"] / times["ours"]
        rows.append(
            {
                "op": op,
                "ours_s": times["ours"],
                "naive_s": times["naive"],
                "ours_mb_s": model_mb / times["ours"],
                "naive_mb_s": model_mb / times["naive"],
                "speedup": speedup,
                "target": target,
                "ok": None if target is None else speedup >= target,
            }
        )
    ratio = enc["ours"] / enc["memcpy"]
    return {
        "topk": topk,
        "peers": peers,
        "repeat": repeat,
        "clip": clip,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "encode_memcpy": {
            "encode_s": enc["ours"],
            "fresh_s": enc["fresh"],
            "memcpy_s": enc["memcpy"],
            "ratio": ratio,
            "target": TARGET_ENCODE_MEMCPY,
            "ok": ratio <= TARGET_ENCODE_MEMCPY,
        },
    }


# --------------------------------------------------------------------------- memory


def memory_report(preset_or_shapes: str | Shapes, case: CodecCase = CodecCase()) -> dict[str, Any]:
    """Peak RSS growth of decode + aggregate + apply of the case's payloads, each in a
    subprocess."""
    shapes = model_shapes(preset_or_shapes)
    copy = _numel(shapes) * 4
    ours_data, naive_data = case.payloads(shapes)
    topk, tile = case.topk, case.tile
    rows = []
    for kind, data in (("lazy", ours_data), ("ours", ours_data), ("naive", naive_data)):
        res = peak_aggregation_bytes(kind, data, shapes, topk=topk, tile=tile, clip=case.clip)
        peak = int(res["peak_bytes"])  # type: ignore[call-overload]
        rows.append(
            {
                "impl": kind,
                "target": TARGET_MEMORY_COPIES if kind == "lazy" else None,
                "ok": peak / copy <= TARGET_MEMORY_COPIES if kind == "lazy" else None,
                "peak_bytes": peak,
                "peak_mb": peak / MB,
                "model_copies": peak / copy,
                "hwm_reset": bool(res["hwm_reset"]),
                "payload_mb": sum(map(len, data)) / MB,
            }
        )
    return {"topk": topk, "peers": case.peers, "model_mb": copy / MB, "rows": rows}


def run(
    json_out: str | None = None,
    preset: str = "base",
    peers: int = 16,
    repeat: int = 3,
    threads: int | None = None,
) -> dict[str, Any]:
    """All three reports on ``preset``; prints the markdown and writes JSON to ``json_out``.

    ``threads`` fixes torch's intra-op threads for the timings (default: as configured).
    """
    shapes = model_shapes(preset)
    results: dict[str, Any] = {
        "model": {
            "preset": preset,
            "params": _numel(shapes),
            "tensors": len(shapes),
            "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
            "torch": torch.__version__,
            "threads": threads or torch.get_num_threads(),
        }
    }
    results["size"] = size_report(shapes)
    case = CodecCase(peers=peers)
    results["speed"] = speed_report(shapes, case, repeat=repeat, threads=threads)
    results["memory"] = memory_report(shapes, case)
    publish(format_markdown(results), results, json_out)
    return results
