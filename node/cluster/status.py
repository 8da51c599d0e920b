"""Following a local run through the coordinator's status endpoint, and the summary it ends with.

``watch`` polls ``/v1/status`` until the run has finished and every node has exited (a node
that exits with an error ends the watch with ``UpError``, its log's tail attached);
``summarize`` turns the final status into what ``sparseloco up --json`` prints: per round the
gather set, exclusions, losses, bytes, timings and every node's fingerprint, and whether the
fingerprints agreed.
"""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from node.cluster.process import Process
from node.errors import UpError
from protocol.messages import RoundState
from protocol.routes import MAX_STATUS_ROUNDS
from protocol.status import StatusView

log = logging.getLogger("sparseloco.up")


def fetch_status(url: str, rounds: int = MAX_STATUS_ROUNDS, timeout: float = 10.0) -> StatusView:
    with urllib.request.urlopen(f"{url}/v1/status?rounds={rounds}", timeout=timeout) as resp:
        return StatusView.model_validate_json(resp.read())


def summarize(status: StatusView) -> dict[str, Any]:
    """The ``--json`` result from the coordinator's final status."""
    rounds = []
    agree = True
    for summary in status.rounds:
        if summary.state != RoundState.CLOSED:
            continue
        fps = dict(summary.fingerprints)
        agree = agree and len(set(fps.values())) <= 1
        rounds.append(
            {
                "round": summary.round,
                "gather": summary.gather,
                "excluded": summary.excluded,
                "fingerprints": fps,
                "eval_loss": _mean([r.eval_loss for r in summary.reports.values()]),
                "train_loss": _mean([r.train_loss for r in summary.reports.values()]),
                "bytes_up": sum(r.bytes_up for r in summary.reports.values()),
                "bytes_down": sum(r.bytes_down for r in summary.reports.values()),
                "duration_s": summary.duration_s,
                "budget_s": summary.budget_s,
                "work": {n: w.model_dump(mode="json") for n, w in summary.work.items()},
                "cut": {n: r.cut for n, r in summary.reports.items() if r.cut is not None},
                "timings": {n: r.timings for n, r in summary.reports.items() if r.timings},
                "throughput": {
                    n: {"tokens_per_s": r.tokens_per_s, "mfu": r.mfu}
                    for n, r in summary.reports.items()
                    if r.tokens_per_s is not None
                },
            }
        )
    # Nodes evaluate on the run's schedule (``RunConfig.eval_every``; the last round always):
    # the final loss is the newest one measured.
    evaluated = [entry["eval_loss"] for entry in rounds if entry["eval_loss"] is not None]
    final = evaluated[-1] if evaluated else None
    return {
        "run_id": status.run_id,
        "run": status.run.model_dump(mode="json"),
        "final_eval_loss": final,
        "fingerprints_agree": agree,
        "rounds": rounds,
    }


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def watch(
    url: str, nodes: list[Process], on_status: Callable[[StatusView], None] | None
) -> StatusView:
    """Poll the coordinator until the run finishes and every node has exited."""
    exited: set[str] = set()
    while True:
        try:
            status = fetch_status(url)
        except (urllib.error.URLError, OSError) as exc:
            raise UpError(f"the coordinator stopped answering: {exc}") from exc
        if on_status:
            on_status(status)
        for node in nodes:
            code = node.poll()
            if code not in (None, 0):
                raise UpError(f"{node.name} exited with code {code}:\n{node.tail()}")
            if code == 0 and node.name not in exited:
                exited.add(node.name)
                log.info("event=node_exited node=%s code=0 round=%d", node.name, status.round)
        if status.state == RoundState.FINISHED and all(n.poll() is not None for n in nodes):
            return status
        time.sleep(0.5)
