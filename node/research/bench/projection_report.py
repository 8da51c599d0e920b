"""``sparseloco bench project``'s tables (the arithmetic is ``projection``, the flags ``cli``).

The SparseLoCo table, the comparison with dense DiLoCo and DDP, and, for ``--link`` profiles
of the WAN lab, what the link adds per round besides its bytes (round trips, slow start,
resets). Flags name the ``Assumptions`` field they set; a bad value is refused by its flag.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from node.research.bench.projection import Assumptions, Row, project
from node.research.bench.wire import Link
from node.research.report import publish
from protocol.errors import ConfigError, Problem, config_error

#: Seconds from which a round is shown as never ending (an object that a reset restarts
#: faster than it can arrive, ``wire.restarted_s``).
NEVER_S = 1e7


def _s(seconds: float, digits: int = 1) -> str:
    return "never" if seconds >= NEVER_S else f"{seconds:,.{digits}f}"


def _share(train_s: float, round_s: float) -> str:
    return "0%" if round_s >= NEVER_S else f"{train_s / round_s:.1%}"


def _size(n: float) -> str:
    return f"{n / 1e9:g} B"


def _rate(mbit: float) -> str:
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def _link(link: Link) -> str:
    """``100 Mbit/s`` for a symmetric link without delay, else its name, rates and RTT."""
    if link.up_mbit == link.down_mbit and not link.rtt_ms and link.reset_every_s is None:
        return _rate(link.up_mbit)
    return f"{link.name} ({link.up_mbit:g}/{link.down_mbit:g} Mbit/s, {link.rtt_ms:g} ms)"


def markdown(a: Assumptions, rows: list[Row]) -> str:
    """The SparseLoCo table, then the comparison with dense DiLoCo and DDP."""
    out = [
        f"G={a.peers}, H={a.inner_steps}, {a.gpus} GPUs x {a.peak_flops / 1e12:g} TFLOP/s at"
        f" {a.mfu:.0%} MFU, {a.tokens_per_step:,} tokens per inner step per node,"
        f" {a.bits_per_param} bits/param",
        "",
        "| model | link | node work | train s | up s | down s | work s | round s | util"
        " | round s, overlap | util, overlap |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.method.startswith("sparseloco"):
            kind = (
                "device (assumed)"
                if "device" in r.method
                else f"CPU, {a.gpus} ranks"
                if "sharded" in r.method
                else "CPU, one process"
            )
            out.append(
                f"| {_size(r.params)} | {_link(r.link)} | {kind} | {r.train_s:,.1f}"
                f" | {r.up_s:,.2f} | {r.down_s:,.1f} | {r.work_s:,.1f} | {_s(r.round_s)}"
                f" | {_share(r.train_s, r.round_s)} | {_s(r.round_overlap_s)}"
                f" | {_share(r.train_s, r.round_overlap_s)} |"
            )
    out += [
        "",
        "| model | link | method | GB moved per node and round | comm s | round s | util"
        " | round s, overlap | util, overlap |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r.method.startswith("sparseloco, CPU work"):
            out.append(
                f"| {_size(r.params)} | {_link(r.link)} | {r.method}"
                f" | {r.bytes_moved / 1e9:,.2f} | {r.comm_s:,.1f} | {_s(r.round_s)}"
                f" | {_share(r.train_s, r.round_s)} | {_s(r.round_overlap_s)}"
                f" | {_share(r.train_s, r.round_overlap_s)} |"
            )
    delayed = [r for r in rows if r.method == "sparseloco, CPU work" and r.link.rtt_ms > 0]
    if delayed:
        out += [
            "",
            "What the link adds per round besides bytes / rate (SparseLoCo, seconds):",
            "",
            "| model | link | round trips | slow start | resets | bytes up + down |",
            "|---|---|---:|---:|---:|---:|",
        ]
        out += [
            f"| {_size(r.params)} | {_link(r.link)} | {r.requests_s:,.2f}"
            f" | {r.slow_start_s:,.2f} | {_s(r.resets_s, 2)} | {r.up_s + r.down_s:,.2f} |"
            for r in delayed
        ]
    return "\n".join(out)


def _count(word: str) -> float:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(word[-1:].upper(), 1.0)
    return float(word[:-1] if scale != 1.0 else word) * scale


#: Fields whose flag is not the field's name with dashes.
_FLAGS = {"links_mbit": "--links", "peak_flops": "--peak-tflops", "profiles": "--link"}


def _flag(problem: Problem) -> str:
    field = str(problem.loc[0]) if problem.loc else ""
    return f"{_FLAGS.get(field, '--' + field.replace('_', '-'))}: {problem.message}"


def assumptions_from(flags: Mapping[str, Any]) -> Assumptions:
    """The flags given (by dest), over the defaults; a bad value raises ``ConfigError`` naming
    its flag."""
    fields = Assumptions.model_fields
    given: dict[str, Any] = {k: v for k, v in flags.items() if k in fields and v is not None}
    for flag, field, parse in (("sizes", "sizes", _count), ("links", "links_mbit", float)):
        text = flags.get(flag)
        if text is not None:
            try:
                given[field] = tuple(parse(w.strip()) for w in text.split(",") if w.strip())
            except ValueError as exc:
                raise ConfigError(f"--{flag}: not a list of numbers: {text!r}") from exc
    if flags.get("peak_tflops") is not None:
        given["peak_flops"] = flags["peak_tflops"] * 1e12
    if flags.get("lab_links") is not None:
        given["profiles"] = tuple(w.strip() for w in flags["lab_links"].split(",") if w.strip())
        given.setdefault("links_mbit", ())  # --link alone: only the profiles
    try:
        return Assumptions(**given)
    except ValidationError as exc:
        raise config_error(exc, _flag) from exc


def run(json_out: str | None = None, **flags: Any) -> dict[str, Any]:
    """Print the tables; with ``--json``, write the inputs and every row too (the report)."""
    a = assumptions_from(flags)
    try:
        rows = project(a)
    except ValueError as exc:  # an unknown --link profile
        raise ConfigError(f"--link: {exc}") from exc
    report = {
        "assumptions": a.model_dump(),
        "rows": [r.model_dump() | {"util": r.util, "util_overlap": r.util_overlap} for r in rows],
    }
    publish(markdown(a, rows), report, json_out)
    return report
