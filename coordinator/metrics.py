"""Prometheus metrics of one coordinator, in a registry of its own (served at ``/metrics``).

A private registry (not the process-global default) lets several apps live in one test process
and keeps the output to what an operator of this service wants to see.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from protocol.messages import MemberState, SignedManifest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
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

    def closed(self, manifests: Iterable[SignedManifest]) -> None:
        for signed in manifests:
            self.rounds_closed.inc()
            self.gathered.inc(len(signed.manifest.gather))
            for reason in signed.manifest.excluded.values():
                self.exclusions.labels(reason=reason).inc()

    def set_members(self, states: Iterable[MemberState]) -> None:
        counts = dict.fromkeys(MemberState, 0)
        for state in states:
            counts[state] += 1
        for state, n in counts.items():
            self.members.labels(state=state.value).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
