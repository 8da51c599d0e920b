"""The invariants a chaos run must keep, as checks over the coordinator's status and the bucket.

Each check returns ``Failure`` values (never raises on a violation), so a run collects all of
them and reports them together. Letters follow the chaos suite's brief:

- (a) agreement: every node that reported round r reports the same fingerprint, except a node
  the manifest of r or r+1 (r+2 with a delayed or eager overlap) excludes as "wrong base
  fingerprint" (a corrupted θ is reported in round r itself and excluded only when it trains
  on it in a later round);
- (b) manifests: the signed manifest in the bucket verifies, matches the status (gather set,
  exclusions) and every gathered payload's size and sha256, unless retention already pruned it;
- (c) no round closed twice: status rounds unique and consecutive, and the coordinator logs
  (all of its lives) say ``event=round_closed round=N`` at most once per round;
- (d) mass: in every report with ``mass``, computed == sent + held up to 1e-4·max(1, scale);
  a node outside the gather set sent 0, a node that trained in the round reported its mass;
- checkpoints: the newest checkpoint's object matches its info and its fingerprint is θ at the
  start of its round (what the nodes reported after the round before);
- retention: no payload of a round both older than ``retention_rounds`` and older than the
  newest checkpoint is left in the bucket, and at most ``keep_checkpoints`` checkpoints are.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from protocol.errors import ManifestError
from protocol.keys import checkpoint_key, latest_checkpoint_key, run_prefix
from protocol.messages import CheckpointInfo, Exclusion, RoundState, SignedManifest
from protocol.signing import verify_manifest
from protocol.status import RoundSummary, StatusView

MASS_RTOL = 1e-4
WRONG_BASE = Exclusion.WRONG_BASE.value
_CLOSED_LINE = re.compile(r"event=round_closed round=(\d+)\b")


@dataclass(frozen=True, order=True)
class Failure:
    invariant: str
    round: int
    detail: str

    def __str__(self) -> str:
        where = f"round {self.round}" if self.round >= 0 else "run"
        return f"[{self.invariant}] {where}: {self.detail}"


#: How long a read waits for a store that answers 500 or drops connections.
STORE_SETTLE_S = 60.0


class Bucket:
    """Read access to the run's objects (boto3 client; ``None`` for a missing key)."""

    def __init__(self, client: Any, bucket: str) -> None:
        self.client = client
        self.bucket = bucket

    def get(self, key: str) -> bytes | None:
        """The object, or None if there is none. A store that has just restarted answers 500
        or drops connections for a moment: the checker waits that out (``STORE_SETTLE_S``)
        rather than report the store's restart as the run's failure."""
        deadline = time.monotonic() + STORE_SETTLE_S
        while True:
            try:
                return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            except self.client.exceptions.NoSuchKey:
                return None
            except (ClientError, BotoCoreError) as exc:
                status = getattr(exc, "response", {}).get("ResponseMetadata", {})
                transient = (
                    not isinstance(exc, ClientError) or status.get("HTTPStatusCode", 0) >= 500
                )
                if not transient or time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def keys(self, prefix: str) -> list[str]:
        out: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out


def closed(status: StatusView) -> list[RoundSummary]:
    return [r for r in status.rounds if r.state == RoundState.CLOSED]


def majority(values: Iterable[str]) -> str | None:
    counts = Counter(values)
    return min(counts, key=lambda v: (-counts[v], v)) if counts else None


def _lag(status: StatusView) -> int:
    """Rounds from applying round r to the first payloads trained on the result ("merge"
    merges it into the next round's training, as without overlap)."""
    return 2 if status.run.late_base else 1


def reference_fingerprint(status: StatusView, round_: int) -> str | None:
    """θ after round r: the base of round r+1's manifest (r+2's with overlap, whose payloads
    train from the θ before the aggregate in flight) when it closed, else the majority."""
    by_round = {r.round: r for r in closed(status)}
    nxt = by_round.get(round_ + _lag(status))
    if nxt is not None and nxt.base_fingerprint:
        return nxt.base_fingerprint
    here = by_round.get(round_)
    return majority(here.fingerprints.values()) if here else None


# ---- (a) agreement -------------------------------------------------------------------------


def check_agreement(status: StatusView) -> tuple[list[Failure], list[dict[str, Any]]]:
    """(a), and one record per closed round for the results: who agreed, who was excused."""
    by_round = {r.round: r for r in closed(status)}
    failures: list[Failure] = []
    records: list[dict[str, Any]] = []
    for r, summary in sorted(by_round.items()):
        ref = reference_fingerprint(status, r)
        wrong_base = {n for n, why in summary.excluded.items() if why == WRONG_BASE}
        for later in range(r + 1, r + 1 + _lag(status)):
            nxt = by_round.get(later)
            if nxt is not None:
                wrong_base |= {n for n, why in nxt.excluded.items() if why == WRONG_BASE}
        dissent = sorted(n for n, fp in summary.fingerprints.items() if fp != ref)
        excused = [n for n in dissent if n in wrong_base]
        for node in dissent:
            if node not in wrong_base:
                failures.append(
                    Failure(
                        "a",
                        r,
                        f"{node} reports {summary.fingerprints[node][:12]}, the others"
                        f" {(ref or '?')[:12]}, and no manifest excludes it as wrong base",
                    )
                )
        records.append(
            {
                "round": r,
                "reported": len(summary.fingerprints),
                "agree": len(summary.fingerprints) - len(dissent),
                "excused": excused,
                "ok": len(dissent) == len(excused),
            }
        )
    return failures, records


# ---- (b) manifests ---------------------------------------------------------------------------


def check_manifest(
    summary: RoundSummary,
    raw: bytes | None,
    public_key: str,
    bucket: Bucket,
    *,
    run_id: str,
    check_payloads: bool = True,
) -> list[Failure]:
    """(b) for one closed round, given the stored manifest's bytes (``None``: missing)."""
    r = summary.round
    if raw is None:
        return [Failure("b", r, "no manifest in the bucket")]
    signed = SignedManifest.model_validate_json(raw)
    m = signed.manifest
    out: list[Failure] = []
    try:
        verify_manifest(signed, public_key)
    except ManifestError:
        out.append(Failure("b", r, "manifest signature does not verify"))
    if m.round != r or m.run_id != run_id:
        out.append(Failure("b", r, f"manifest is for {m.run_id} round {m.round}"))
    if [e.node_id for e in m.gather] != sorted(summary.gather):
        out.append(Failure("b", r, f"manifest gather {m.gather} != status {summary.gather}"))
    if m.excluded != summary.excluded:
        out.append(Failure("b", r, f"manifest excluded {m.excluded} != {summary.excluded}"))
    if m.base_fingerprint != summary.base_fingerprint:
        out.append(Failure("b", r, "manifest base fingerprint differs from the status"))
    if not check_payloads:
        return out
    for entry in m.gather:
        body = bucket.get(entry.key)
        if body is None:
            out.append(Failure("b", r, f"payload of {entry.node_id} missing: {entry.key}"))
        elif len(body) != entry.size or hashlib.sha256(body).hexdigest() != entry.sha256:
            out.append(Failure("b", r, f"payload of {entry.node_id} differs from the manifest"))
    return out


# ---- (c) no round closed twice ------------------------------------------------------------


def check_round_numbers(status: StatusView) -> list[Failure]:
    numbers = [r.round for r in status.rounds]
    out = []
    if len(numbers) != len(set(numbers)):
        dupes = sorted(n for n, c in Counter(numbers).items() if c > 1)
        out.append(Failure("c", dupes[0], f"status lists rounds {dupes} more than once"))
    if numbers and numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        out.append(Failure("c", -1, f"status rounds not consecutive: {numbers}"))
    done = [r.round for r in closed(status)]
    if done and done != list(range(len(done))):
        out.append(Failure("c", -1, f"closed rounds not 0..{len(done) - 1}: {done}"))
    return out


def check_close_logs(logs: Iterable[Path]) -> list[Failure]:
    counts: Counter[int] = Counter()
    for path in logs:
        counts.update(int(n) for n in _CLOSED_LINE.findall(path.read_text(errors="replace")))
    return [
        Failure("c", r, f"coordinator logs close round {r} {n} times")
        for r, n in sorted(counts.items())
        if n > 1
    ]


# ---- (d) error-feedback mass --------------------------------------------------------------


def check_mass(status: StatusView) -> list[Failure]:
    out = []
    for summary in closed(status):
        r = summary.round
        for node, report in sorted(summary.reports.items()):
            mass = report.mass
            if mass is None:
                # A replay (catch-up, resync) reports no mass: it trained nothing. A report of
                # a round the node trained in (it has a train loss) must account for it.
                if node in summary.gather and report.train_loss is not None:
                    out.append(Failure("d", r, f"{node} trained in this round, reports no mass"))
                continue
            gap = abs(mass.computed - mass.sent - mass.held)
            if gap > MASS_RTOL * max(1.0, mass.scale):
                out.append(
                    Failure(
                        "d",
                        r,
                        f"{node}: computed {mass.computed:.6g} != sent {mass.sent:.6g}"
                        f" + held {mass.held:.6g} (gap {gap:.3g}, scale {mass.scale:.3g})",
                    )
                )
            if node not in summary.gather and mass.sent != 0.0:
                why = summary.excluded.get(node, "not gathered")
                out.append(Failure("d", r, f"{node} ({why}) reports sent={mass.sent:.6g}, not 0"))
    return out


# ---- checkpoints and retention ------------------------------------------------------------


def check_checkpoint(status: StatusView, bucket: Bucket, prefix: str) -> list[Failure]:
    """The newest checkpoint: stored as announced, θ at the start of its round, latest.json."""
    info = status.checkpoint
    run = status.run
    last = max((r.round for r in closed(status)), default=-1)
    if info is None:
        if run.checkpoint_every and last >= run.checkpoint_every:
            return [Failure("ckpt", -1, f"no checkpoint after {last + 1} closed rounds")]
        return []
    out = []
    r = info.round
    if info.key != checkpoint_key(prefix, status.run_id, r):
        out.append(Failure("ckpt", r, f"checkpoint key {info.key} is not the layout's"))
    body = bucket.get(info.key)
    if body is None:
        out.append(Failure("ckpt", r, f"checkpoint object missing: {info.key}"))
    elif len(body) != info.size or hashlib.sha256(body).hexdigest() != info.sha256:
        out.append(Failure("ckpt", r, "checkpoint object differs from its size/sha256"))
    expected = reference_fingerprint(status, r - 1)
    if expected is not None and info.fingerprint != expected:
        out.append(
            Failure("ckpt", r, f"checkpoint fingerprint {info.fingerprint[:12]} is not θ_{r}")
        )
    latest = bucket.get(latest_checkpoint_key(prefix, status.run_id))
    if latest is None:
        out.append(Failure("ckpt", r, "checkpoints/latest.json missing"))
    elif CheckpointInfo.model_validate_json(latest).round != r:
        out.append(Failure("ckpt", r, "checkpoints/latest.json names another round"))
    return out


_PAYLOAD = re.compile(r"rounds/(\d{8})/payloads/")
_CKPT = re.compile(r"checkpoints/(\d{8})/model\.safetensors$")


def check_retention(status: StatusView, bucket: Bucket, prefix: str) -> list[Failure]:
    run = status.run
    last = max((r.round for r in closed(status)), default=-1)
    ckpt = status.checkpoint.round if status.checkpoint else -1
    keys = bucket.keys(run_prefix(prefix, status.run_id))
    # One round of slack: pruning may run just before or just after the newest close.
    stale = sorted(
        {
            int(m[1])
            for k in keys
            if (m := _PAYLOAD.search(k))
            and int(m[1]) < last - run.retention_rounds - 1
            and int(m[1]) < ckpt
        }
    )
    out = []
    if stale:
        out.append(Failure("retention", -1, f"payloads of rounds {stale} outlived retention"))
    ckpts = sorted({int(m[1]) for k in keys if (m := _CKPT.search(k))})
    # One checkpoint of slack: the newest may have been committed just before this look, with
    # the pruning pass it kicked still under way (as with payloads, one round of slack).
    newest = 1 if ckpts and ckpts[-1] == ckpt else 0
    if len(ckpts) > run.keep_checkpoints + newest:
        out.append(
            Failure(
                "retention",
                -1,
                f"{len(ckpts)} checkpoints kept ({ckpts}), keep {run.keep_checkpoints}",
            )
        )
    return out
