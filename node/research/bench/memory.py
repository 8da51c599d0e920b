"""Peak memory of one aggregation, measured as resident-set growth in a fresh subprocess.

torch's CPU allocations bypass ``tracemalloc``, so the only honest measure is the process's own
peak RSS. ``peak_aggregation_bytes`` writes the peers' payloads to a temporary directory and
starts ``python -m node.research.bench.memory`` on them. The child loads the payload bytes and
builds the parameters, runs the aggregation once as a warm-up (lazy initialisation, thread pools),
returns freed heap pages to the kernel (``malloc_trim``), resets the kernel's high-water mark
(``echo 5 > /proc/self/clear_refs``), records ``VmRSS``, runs parse + aggregate + apply once
more and reports ``VmHWM - VmRSS``: the extra memory that aggregation needed at its peak.
Where the high-water mark cannot be reset, the growth over the previous high-water mark is
reported instead (a lower bound) and ``hwm_reset`` is false. Linux only.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[3]


def _status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (e.g. ``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: pages may stay resident
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _aggregate_once(
    kind: str,
    datas: list[bytes],
    shapes: dict[str, tuple[int, ...]],
    params: dict[str, torch.Tensor],
    topk: int,
    tile: int,
    clip: bool,
) -> None:
    if kind in ("ours", "lazy"):
        from node.compute.outer import AggregateOptions, apply_aggregate
        from protocol.codec import read_payload

        payloads = {
            f"peer{i:03d}": read_payload(d, shapes, topk=topk, tile=tile, lazy=kind == "lazy")
            for i, d in enumerate(datas)
        }
        apply_aggregate(params, payloads, AggregateOptions(clip=clip))
    elif kind == "naive":
        from node.research.bench import naive

        naive.apply(params, datas, topk=topk, tile_size=tile, clip=clip)
    else:
        raise ValueError(f"unknown aggregation kind {kind!r}")


def _child(kind: str, directory: str, topk: int, tile: int, clip: bool) -> dict[str, object]:
    """Runs in the subprocess: measure one aggregation, return the numbers."""
    root = Path(directory)
    shapes = {n: tuple(s) for n, s in json.loads((root / "shapes.json").read_text()).items()}
    datas = [p.read_bytes() for p in sorted(root.glob("peer*.bin"))]
    params = {n: torch.full(s, 0.5) for n, s in shapes.items()}
    _aggregate_once(kind, datas, shapes, params, topk, tile, clip)  # warm-up
    _trim()
    hwm_before = _status_kib("VmHWM")
    reset = _reset_hwm()
    rss = _status_kib("VmRSS")
    _aggregate_once(kind, datas, shapes, params, topk, tile, clip)
    hwm = _status_kib("VmHWM")
    base = rss if reset else hwm_before
    return {
        "peak_bytes": max(0, hwm - base) * 1024,
        "baseline_rss_bytes": rss * 1024,
        "hwm_reset": reset,
    }


def peak_aggregation_bytes(
    kind: str,
    payloads: Sequence[bytes],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    topk: int,
    tile: int = 64,
    clip: bool = True,
) -> dict[str, object]:
    """Peak extra RSS of parse + aggregate + apply of ``payloads``.

    ``kind``: ``lazy`` (ours as the node reads payloads), ``ours`` (eager decode) or ``naive``.
    """
    with tempfile.TemporaryDirectory(prefix="slc-mem-") as tmp:
        root = Path(tmp)
        (root / "shapes.json").write_text(json.dumps({n: list(s) for n, s in shapes.items()}))
        for i, data in enumerate(payloads):
            (root / f"peer{i:03d}.bin").write_bytes(data)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
        cmd = [
            sys.executable,
            "-m",
            "node.research.bench.memory",
            kind,
            tmp,
            str(topk),
            str(tile),
            str(int(clip)),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"memory child failed ({proc.returncode}): {proc.stderr[-2000:]}")
        result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
        return result


if __name__ == "__main__":
    _kind, _dir, _topk, _tile, _clip = sys.argv[1:6]
    print(json.dumps(_child(_kind, _dir, int(_topk), int(_tile), bool(int(_clip)))))
