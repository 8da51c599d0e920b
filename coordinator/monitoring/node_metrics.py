"""The nodes' own metrics, as their round reports push them to the coordinator's ``/metrics``.

Nodes run behind NAT and open no port; every report a node sends after applying a round carries
its losses, per-phase timings, bytes moved and the failed attempts it made at the coordinator or
the store since its previous report. The coordinator turns them into per-node series, labelled
by ``node``:

- gauges of the newest report: ``sparseloco_node_train_loss``, ``sparseloco_node_eval_loss``,
  ``sparseloco_node_step_seconds`` (training time / H), ``sparseloco_node_phase_seconds``
  (``phase`` label: train, encode, upload, wait, download, decode, aggregate_apply, save, eval),
  ``sparseloco_node_transfer_bytes_per_second`` (``direction``: up, down),
  ``sparseloco_node_tokens_per_second`` and ``sparseloco_node_mfu`` (of the inner steps; MFU
  only from nodes on a device of known peak), ``sparseloco_node_last_round``,
  ``sparseloco_node_steps`` and ``sparseloco_node_tokens`` (the work of its newest round) and
  ``sparseloco_node_topk`` (entries per tile it sent: below the run's when its link is thin);
- from each closed round's manifest (after a restart, from the next one):
  ``sparseloco_node_work_share``, its share of the round's work (its steps over everyone's
  gathered; ``protocol.work``);
- counters over the whole run: ``sparseloco_node_bytes`` (``direction``),
  ``sparseloco_node_retries`` and ``sparseloco_node_cut_rounds`` (``by``: compute, the round's
  time budget ended its training; link, it also sent fewer entries per tile; observing, its
  link could not get a payload in at all).

Like the coordinator's own counters they describe the run, not the process: at start they are
rebuilt from the reports in the database (``from_reports``), so a restart loses nothing; a stored
report that no longer validates is skipped rather than stopping the start.

A node whose token the operator revoked takes no further part, so its gauges (the live figures:
losses, timings, rates, tokens/s, MFU, last round) are dropped (``forget``), at once and at every
later start; its counters stay, as the run's history of what was moved and retried. A revoked
token cannot report again; the figures come back only if the node rejoins with a new token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import ValidationError

from coordinator.state.db import Database
from protocol.messages import Manifest
from protocol.reports import RoundReport
from protocol.work import work_shares

#: A per-node series: a gauge of the newest report, or a counter over the run.
S = TypeVar("S", Gauge, Counter)

#: Each series' help text, by its name after ``sparseloco_node_``.
HELP = {
    "train_loss": "Mean training loss of the node's newest round",
    "eval_loss": "Held-out loss after the node's newest round",
    "step_seconds": "Seconds per inner step in the node's newest round",
    "phase_seconds": "Seconds per phase of the node's newest round",
    "transfer_bytes_per_second": (
        "Payload bytes per second of the node's newest upload and download"
    ),
    "tokens_per_second": "Tokens per second of the inner steps in the node's newest round",
    "mfu": "Model FLOPs utilisation of the inner steps in the node's newest round",
    "last_round": "The newest round the node reported",
    "bytes": "Payload bytes the node moved over the run",
    "retries": "Failed attempts at the coordinator or the store the node reported",
    "steps": "Inner steps the node trained in its newest round",
    "tokens": "Tokens its newest round's steps read",
    "topk": "Entries per tile the node sent in its newest round",
    "work_share": "The node's share of the newest closed round's work (its steps over all)",
    "cut_rounds": "Rounds whose training the node's time budget cut short, by what cut it",
}


class NodeMetrics:
    """Per-node series in ``registry``; ``observe`` one report at a time, in round order."""

    def __init__(self, registry: CollectorRegistry, inner_steps: int, topk: int = 64) -> None:
        self.inner_steps = max(1, inner_steps)
        self.run_topk = topk

        # Every series is labelled by ``node``; some also by a ``phase`` or a ``direction``.
        def series(kind: type[S], name: str, *labels: str) -> S:
            full = f"sparseloco_node_{name}"
            return kind(full, HELP[name], ["node", *labels], registry=registry)

        self.train_loss = series(Gauge, "train_loss")
        self.eval_loss = series(Gauge, "eval_loss")
        self.step_seconds = series(Gauge, "step_seconds")
        self.phase_seconds = series(Gauge, "phase_seconds", "phase")
        self.rate = series(Gauge, "transfer_bytes_per_second", "direction")
        self.tokens_per_s = series(Gauge, "tokens_per_second")
        self.mfu = series(Gauge, "mfu")
        self.last_round = series(Gauge, "last_round")
        self.bytes = series(Counter, "bytes", "direction")
        self.retries = series(Counter, "retries")
        self.steps = series(Gauge, "steps")
        self.tokens = series(Gauge, "tokens")
        self.topk = series(Gauge, "topk")
        self.work_share = series(Gauge, "work_share")
        self.cut_rounds = series(Counter, "cut_rounds", "by")
        #: Each node's phases with a ``phase_seconds`` series (so ``forget`` can remove them).
        self._phases: dict[str, set[str]] = {}

    def observe(self, node: str, round_: int, report: RoundReport) -> None:
        """Account one report (the newest of ``node``'s so far)."""
        self.last_round.labels(node=node).set(round_)
        self.bytes.labels(node=node, direction="up").inc(report.bytes_up)
        self.bytes.labels(node=node, direction="down").inc(report.bytes_down)
        self.retries.labels(node=node).inc(report.retries)
        if report.train_loss is not None:
            self.train_loss.labels(node=node).set(report.train_loss)
        if report.eval_loss is not None:
            self.eval_loss.labels(node=node).set(report.eval_loss)
        if report.tokens_per_s is not None:
            self.tokens_per_s.labels(node=node).set(report.tokens_per_s)
        if report.mfu is not None:
            self.mfu.labels(node=node).set(report.mfu)
        if report.steps is not None:
            self.steps.labels(node=node).set(report.steps)
        if report.tokens is not None:
            self.tokens.labels(node=node).set(report.tokens)
        if report.topk is not None or report.steps is not None:
            self.topk.labels(node=node).set(report.topk or self.run_topk)
        if report.cut is not None:
            self.cut_rounds.labels(node=node, by=report.cut).inc()
        t = report.timings
        for phase, seconds in t.items():
            self.phase_seconds.labels(node=node, phase=phase).set(seconds)
        self._phases.setdefault(node, set()).update(t)
        if "train" in t:
            steps = report.steps or self.inner_steps  # a round cut short took fewer
            self.step_seconds.labels(node=node).set(t["train"] / steps)

        for direction, moved, phase in (
            ("up", report.bytes_up, "upload"),
            ("down", report.bytes_down, "download"),
        ):
            if moved and t.get(phase, 0.0) > 0:
                self.rate.labels(node=node, direction=direction).set(moved / t[phase])

    def observe_work(self, manifest: Manifest) -> None:
        """A round closed: each gathered node's share of its work."""
        for node, share in work_shares(manifest.steps(), self.inner_steps).items():
            self.work_share.labels(node=node).set(share)

    def forget(self, nodes: Iterable[str]) -> None:
        """Drop the live figures (every gauge) of ``nodes``, revoked; their counters stay."""
        for node in nodes:
            for gauge in (
                self.train_loss, self.eval_loss, self.step_seconds, self.tokens_per_s,
                self.mfu, self.last_round, self.steps, self.tokens, self.topk, self.work_share,
            ):  # fmt: skip
                with contextlib.suppress(KeyError):  # never reported that figure
                    gauge.remove(node)
            for direction in ("up", "down"):
                with contextlib.suppress(KeyError):
                    self.rate.remove(node, direction)
            for phase in self._phases.pop(node, set()):
                self.phase_seconds.remove(node, phase)

    def from_reports(self, db: Database) -> None:
        """Rebuild every series from the reports the database holds (at start)."""
        rows = db.execute("SELECT round, node_id, report FROM reports ORDER BY round").fetchall()
        for round_, node, body in rows:
            try:
                report = RoundReport.model_validate_json(body)
            except ValidationError:
                continue  # stored before a tighter wire model; the status view logs it
            self.observe(str(node), int(round_), report)
