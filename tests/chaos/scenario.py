"""What a chaos scenario is: a run config, some nodes, and fault steps keyed to rounds.

A step fires when the coordinator's status shows its round open (``when="open"``: the round is
the current one, or already past) or closed (``when="closed"``). Steps fire in the order given,
one after the other, so ``kill_coordinator`` then ``restart_coordinator`` at the same round is a
kill followed by a restart on the same port. Node faults inside a round (a crash at an exact
point, a straggler, a corrupted θ) are not steps but the node's faults: ``SPARSELOCO_FAULTS``
(``node.daemon.faults``) and ``corrupt@R`` (``support.diverge``), given per node in
``Scenario.faults`` or with a ``start_node`` / ``restart_node`` step.

Actions (``target`` is a node name where one is needed):

- ``kill_node``: SIGKILL the node's process (``kill -9``); ``restart_node`` starts it again on
  the same state directory (``faults=`` arms it for the new process);
- ``start_node``: first start of a node not started with the others (a late joiner);
- ``kill_coordinator`` / ``restart_coordinator``: SIGKILL it, start it again on the same port;
- ``coordinator_outage``: SIGKILL the coordinator and start it again on the same port after
  ``min_s`` (nodes keep running and must wait it out);
- ``store_outage``: stop the object store, start it again once a node logged
  ``event=unreachable service=store`` after the stop and at least ``min_s`` passed, or after
  ``max_s`` as a last resort (the scenario then gets its own store, never the session's one);
- ``pause_node``: SIGSTOP the node until the coordinator shows it timed out (or ``max_s``),
  then SIGCONT (a heartbeat timeout).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Literal

from protocol.runconfig import RunConfig

When = Literal["open", "closed"]

NODE_ACTIONS = frozenset({"kill_node", "restart_node", "start_node", "pause_node"})
ACTIONS = NODE_ACTIONS | {
    "kill_coordinator",
    "restart_coordinator",
    "coordinator_outage",
    "store_outage",
}

_FAULT = re.compile(r"^(crash:[a-z_]+|slow:[0-9.]+|slower:[0-9.]+|corrupt)@(\d+)$")


@dataclass(frozen=True)
class Step:
    """One fault step: ``action`` on ``target`` once round ``round`` is ``when``."""

    round: int
    action: str
    target: str | None = None
    when: When = "open"
    #: ``SPARSELOCO_FAULTS`` for ``start_node`` / ``restart_node``.
    faults: str | None = None
    #: ``store_outage`` / ``pause_node``: shortest and longest time the fault lasts.
    min_s: float = 0.0
    max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; one of {sorted(ACTIONS)}")
        if (self.action in NODE_ACTIONS) != (self.target is not None):
            need = "needs" if self.action in NODE_ACTIONS else "takes no"
            raise ValueError(f"{self.action} {need} node target")

    def describe(self) -> str:
        who = f" {self.target}" if self.target else ""
        armed = f" [{self.faults}]" if self.faults else ""
        return f"{self.action}{who}{armed} @{self.when} {self.round}"


def at(round_: int, action: str, target: str | None = None, **kw: object) -> Step:
    """``at(3, "kill_node", "node-1")``: a step at round 3 (see ``Step`` for keywords)."""
    return Step(round_, action, target, **kw)  # type: ignore[arg-type]


def fault_entries(text: str | None) -> list[tuple[str, int]]:
    """``[(action, round)]`` of a ``SPARSELOCO_FAULTS`` value (see ``node.daemon.faults``)."""
    from node.daemon.faults import Faults
    from support.diverge import split_faults

    Faults.parse(split_faults(text)[0])  # raises ConfigError on a typo, before any process starts
    out = []
    for raw in (text or "").split(","):
        m = _FAULT.match(raw.strip())
        if m:
            out.append((m[1], int(m[2])))
    return out


@dataclass(frozen=True)
class Scenario:
    """A run config, ``nodes`` nodes (``node-0``...), per-node faults and fault steps."""

    name: str
    run: RunConfig
    nodes: int
    steps: tuple[Step, ...] = ()
    #: node -> ``SPARSELOCO_FAULTS`` for its first start.
    faults: dict[str, str] = field(default_factory=dict)
    #: Rounds a faulted node may take to be back in a gather set, counted from its return to
    #: the run (``results``: the round it joined again in, else the fault's round). A node
    #: back during round J takes part from J, or J+1 if J already had submissions
    #: (``coordinator.rules.rounds.joined_round_for``); its first round replays the rounds it missed
    #: and, in a fresh process, compiles the codec. Measured: 1 round on a quiet machine, 2
    #: with a CPU hog beside a loaded 2-core machine (load 16); 3 leaves a round of margin
    #: for a busier one and still fails a node that is back but not taken, which is what the
    #: check is for (a refused payload, a wrong round number).
    recover_within: int = 3
    #: Relative tolerance of the eval loss against the fault-free run after the same number
    #: of outer steps (``results.compare_to_baseline``).
    loss_tolerance: float = 0.05
    #: Safety net for the whole scenario; every wait inside is keyed to rounds.
    timeout_s: float = 600.0
    #: Run the fault-free baseline at the same time as the scenario, not before it: for a
    #: scenario that spends most of its time waiting out outages, with long deadlines, the cores
    #: it leaves idle run the baseline (whose verdict and loss do not depend on time either).
    baseline_beside: bool = False

    def __post_init__(self) -> None:
        names = set(self.names)
        for step in self.steps:
            if step.target is not None and step.target not in names:
                raise ValueError(f"{step.describe()}: no node {step.target!r} in {sorted(names)}")
            if step.round >= self.run.rounds:
                raise ValueError(f"{step.describe()}: the run has only {self.run.rounds} rounds")
        for name, text in self.faults.items():
            if name not in names:
                raise ValueError(f"faults for unknown node {name!r}")
            fault_entries(text)

    @property
    def names(self) -> list[str]:
        return [f"node-{i}" for i in range(self.nodes)]

    @property
    def late(self) -> set[str]:
        """Nodes first started by a ``start_node`` step."""
        return {s.target for s in self.steps if s.action == "start_node" and s.target}

    @property
    def needs_own_store(self) -> bool:
        return any(s.action == "store_outage" for s in self.steps)

    def baseline(self) -> Scenario:
        """The same run, every node from the start, no faults."""
        return replace(self, name=f"{self.name}-baseline", steps=(), faults={})
