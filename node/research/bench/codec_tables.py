"""The codec benchmark's results as Markdown tables (what the README shows).

``format_markdown`` turns the JSON-ready results of ``node.research.bench.codec_bench.run``
(payload size, throughput, aggregation memory) into the tables printed by
``sparseloco bench codec``; every row says whether its target was met.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MB = 1e6
_IMPL = {
    "lazy": "ours, the node's path (lazy read)",
    "ours": "ours, eager read",
    "naive": "production path (naive torch)",
}


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def format_markdown(results: Mapping[str, Any]) -> str:
    """README-ready markdown tables of whichever reports ``results`` holds."""
    out = []
    if (m := results.get("model")) is not None:
        out.append(
            f"Model `{m['preset']}`: {m['params'] / 1e6:.2f} M parameters in "
            f"{m['tensors']} tensors ({m['params'] * 4 / MB:.1f} MB fp32); "
            f"{m['machine']}, torch {m['torch']}, "
            f"{m['threads']} thread{'' if m['threads'] == 1 else 's'}."
        )
    if (s := results.get("size")) is not None:
        out.append(
            _table(
                [
                    "input",
                    "k",
                    "ours (bits/param)",
                    "bound",
                    "12-bit + byte codes",
                    "ours / bound",
                    "ours / 12-bit",
                    "target met",
                ],
                [
                    [
                        r["input"],
                        str(r["k"]),
                        f"{r['ours_bpp']:.4f}",
                        f"{r['bound_bpp']:.4f}",
                        f"{r['production_bpp']:.4f}",
                        f"{r['ratio_to_bound']:.3f} (≤ 1.04)",
                        f"{r['ratio_to_production']:.3f} (≤ 0.5)",
                        _mark(r["ok"]),
                    ]
                    for r in s["rows"]
                ],
            )
        )
    if (p := results.get("speed")) is not None:
        out.append(
            f"Throughput at k={p['topk']}, best of {p['repeat']} after a warm-up "
            f"(MB/s of fp32 parameters):"
        )
        out.append(
            _table(
                ["operation", "ours", "naive torch", "speedup", "target met"],
                [
                    [
                        r["op"],
                        f"{r['ours_s'] * 1e3:.0f} ms ({r['ours_mb_s']:.0f} MB/s)",
                        f"{r['naive_s'] * 1e3:.0f} ms ({r['naive_mb_s']:.0f} MB/s)",
                        f"{r['speedup']:.2f}x"
                        + (f" (≥ {r['target']}x)" if r["target"] is not None else ""),
                        _mark(r["ok"]) if r["ok"] is not None else "-",
                    ]
                    for r in p["rows"]
                ],
            )
        )
        if (e := p.get("encode_memcpy")) is not None:
            out.append(
                _table(
                    [
                        "encode (reused buffers)",
                        "encode (fresh buffers)",
                        "memory copy of the same bytes",
                        "encode / copy",
                        "target met",
                    ],
                    [
                        [
                            f"{e['encode_s'] * 1e3:.3g} ms",
                            f"{e['fresh_s'] * 1e3:.3g} ms",
                            f"{e['memcpy_s'] * 1e3:.3g} ms",
                            f"{e['ratio']:.1f}x (≤ {e['target']}x)",
                            _mark(e["ok"]),
                        ]
                    ],
                )
            )
    if (q := results.get("memory")) is not None:
        out.append(
            f"Peak memory of decode + aggregate + apply of {q['peers']} payloads at "
            f"k={q['topk']} (RSS growth in a fresh process; one fp32 model copy = "
            f"{q['model_mb']:.1f} MB):"
        )
        out.append(
            _table(
                [
                    "implementation",
                    "peak extra RSS",
                    "fp32 model copies",
                    "payloads held",
                    "target met",
                ],
                [
                    [
                        _IMPL.get(r["impl"], r["impl"]),
                        f"{r['peak_mb']:.1f} MB" + ("" if r["hwm_reset"] else " (lower bound)"),
                        f"{r['model_copies']:.2f}"
                        + (f" (≤ {r['target']})" if r.get("target") is not None else ""),
                        f"{r['payload_mb']:.1f} MB",
                        _mark(r["ok"]) if r.get("ok") is not None else "-",
                    ]
                    for r in q["rows"]
                ],
            )
        )
    return "\n\n".join(out) + "\n"
