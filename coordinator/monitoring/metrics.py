"""Prometheus metrics of one coordinator, in a registry of its own (served at ``/metrics``).

A private registry (not the process-global default) lets several apps live in one test process
and keeps the output to what an operator of this service wants to see.

The counters describe the run, not the process: at start they are set to what the database
records (``totals``: rounds closed, payloads gathered, exclusions and submissions by reason,
checkpoints committed, objects deleted), so a restart does not send them back to zero. Only
``sparseloco_manifest_publish_failures`` counts from the start of the process (failed uploads
leave no trace in the database).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from coordinator.monitoring.node_metrics import NodeMetrics
from coordinator.state.db import DELETED, Database
from protocol.messages import MemberState, RoundState, SignedManifest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Totals:
    """What the run's counters add up to, as the database records them."""

    rounds_closed: int = 0
    gathered: int = 0
    #: Exclusion reason -> count.
    exclusions: dict[str, int] = field(default_factory=dict)
    #: ``accepted`` or the rejection reason -> count.
    submissions: dict[str, int] = field(default_factory=dict)
    checkpoints: int = 0
    #: ``payload`` / ``checkpoint`` -> objects deleted.
    deleted: dict[str, int] = field(default_factory=dict)


def totals(db: Database) -> Totals:
    """The counters' values from the tables (one pass of aggregate queries, no row parsing)."""
    closed = RoundState.CLOSED.value
    n_closed, gathered = db.execute(
        "SELECT COUNT(*), COALESCE(SUM(json_array_length(signed_manifest, '$.manifest.gather')),"
        " 0) FROM rounds WHERE state=?",
        (closed,),
    ).fetchone()
    exclusions = db.execute(
        "SELECT e.value, COUNT(*) FROM rounds, json_each(rounds.signed_manifest,"
        " '$.manifest.excluded') AS e WHERE rounds.state=? GROUP BY e.value",
        (closed,),
    ).fetchall()
    submissions = db.execute(
        "SELECT COALESCE(rejected, 'accepted') AS result, COUNT(*) FROM submissions GROUP BY result"
    ).fetchall()
    (checkpoints,) = db.execute("SELECT COUNT(*) FROM checkpoints").fetchone()
    deleted = db.execute(
        "SELECT substr(key, ?), value FROM meta WHERE key LIKE ?",
        (len(DELETED) + 1, DELETED + "%"),
    ).fetchall()
    return Totals(
        rounds_closed=int(n_closed),
        gathered=int(gathered),
        exclusions={str(r): int(n) for r, n in exclusions},
        submissions={str(r): int(n) for r, n in submissions},
        checkpoints=int(checkpoints),
        deleted={str(k): int(v) for k, v in deleted},
    )


class CoordinatorMetrics:
    def __init__(
        self, start: Totals | None = None, *, inner_steps: int = 1, topk: int = 64
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        #: The nodes' series, from their reports (``coordinator.monitoring.node_metrics``).
        self.nodes = NodeMetrics(self.registry, inner_steps, topk)
        self.rounds_closed = Counter(
            "sparseloco_rounds_closed", "Rounds closed", registry=self.registry
        )
        self.gathered = Counter(
            "sparseloco_payloads_gathered", "Payloads in closed rounds' gather sets",
            registry=self.registry,
        )  # fmt: skip
        self.submissions = Counter(
            "sparseloco_submissions", "Submissions received", ["result"], registry=self.registry
        )
        self.exclusions = Counter(
            "sparseloco_exclusions", "Nodes excluded from closed rounds", ["reason"],
            registry=self.registry,
        )  # fmt: skip
        self.members = Gauge(
            "sparseloco_members", "Members by state", ["state"], registry=self.registry
        )
        self.round = Gauge("sparseloco_round", "The current round", registry=self.registry)
        self.publish_failures = Counter(
            "sparseloco_manifest_publish_failures", "Failed manifest uploads (retried)",
            registry=self.registry,
        )  # fmt: skip
        self.deleted = Counter(
            "sparseloco_objects_deleted", "Objects deleted by retention", ["kind"],
            registry=self.registry,
        )  # fmt: skip
        self.checkpoints = Counter(
            "sparseloco_checkpoints_committed", "Checkpoints committed", registry=self.registry
        )
        if start is not None:
            self._start_from(start)

    def _start_from(self, start: Totals) -> None:
        """Counters at the run's totals so far (a fresh process, an existing database)."""
        self.rounds_closed.inc(start.rounds_closed)
        self.gathered.inc(start.gathered)
        self.checkpoints.inc(start.checkpoints)
        for reason, n in start.exclusions.items():
            self.exclusions.labels(reason=reason).inc(n)
        for result, n in start.submissions.items():
            self.submissions.labels(result=result).inc(n)
        for kind, n in start.deleted.items():
            self.deleted.labels(kind=kind).inc(n)

    def closed(self, manifests: Iterable[SignedManifest]) -> None:
        for signed in manifests:
            self.rounds_closed.inc()
            self.gathered.inc(len(signed.manifest.gather))
            for reason in signed.manifest.excluded.values():
                self.exclusions.labels(reason=reason).inc()
            self.nodes.observe_work(signed.manifest)

    def set_members(self, states: Iterable[MemberState]) -> None:
        counts = dict.fromkeys(MemberState, 0)
        for state in states:
            counts[state] += 1
        for state, n in counts.items():
            self.members.labels(state=state.value).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
