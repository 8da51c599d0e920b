"""Catch-up and recovery benchmark (run by hand): ``python tests/bench/catchup.py [--json OUT]``.

Two measurements on a local cluster of real processes (SeaweedFS, coordinator, nodes):

1. **Catch-up, 50 rounds behind.** Three nodes run ``--behind`` rounds; then a fourth node
   joins. Without a checkpoint it replays every round from θ_0 (downloading each round's
   gather set); with checkpoints every ``--behind`` rounds it downloads one checkpoint and
   replays nothing. Reported: bytes downloaded and seconds until its first report of the
   current round, against the size of one full checkpoint.
2. **Recovery after kill -9.** A node is killed with SIGKILL while the run goes on and is
   restarted at once; reported: rounds from the kill until it is back in a gather set.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.cluster.seaweed import EmbeddedStore
from protocol.messages import RoundState
from protocol.runconfig import RunConfig, Timing
from protocol.status import StatusView
from support.cluster import Cluster, closed_count

TIMING = Timing(first_round_s=120, min_round_s=60, max_round_s=120, heartbeat_timeout_s=30)


def _run(rounds: int, checkpoint_every: int) -> RunConfig:
    return RunConfig(
        name="catchup",
        model="tiny",
        rounds=rounds,
        inner_steps=5,
        batch_size=4,
        min_nodes=3,
        checkpoint_every=checkpoint_every,
        retention_rounds=max(rounds, checkpoint_every + 1),
        timing=TIMING,
    )


def _late_join(root: Path, store: EmbeddedStore, behind: int, checkpoint_every: int) -> dict:
    run = _run(behind + 4, checkpoint_every)
    cluster = Cluster(root, store, run, 4)
    try:
        cluster.start_coordinator()
        for name in ("node-0", "node-1", "node-2"):
            cluster.start_node(name)
        cluster.wait_closed(behind)
        # node-2 leaves, so the run waits for a third node (min_nodes=3): node-3, which must
        # first catch up. That keys the measurement to rounds, not to how fast the others go.
        cluster.nodes["node-2"].stop()
        cluster.wait_for("the run to wait", lambda s: s.state == RoundState.WAITING)
        at_start = closed_count(cluster.status())
        t0 = time.monotonic()
        cluster.start_node("node-3")

        def caught_up(s: StatusView) -> bool:
            return any("node-3" in r.gather for r in s.rounds if r.state == RoundState.CLOSED)

        status = cluster.wait_for("node-3 to contribute", caught_up)
        seconds = time.monotonic() - t0
        replayed = [
            r for r in status.rounds if "node-3" in r.reports and not r.reports["node-3"].bytes_up
        ]
        bytes_down = sum(r.reports["node-3"].bytes_down for r in replayed)
        checkpoint = status.checkpoint.size if status.checkpoint else None
        del cluster.nodes["node-2"]  # it left on purpose; wait_finished checks the others
        cluster.wait_finished()
        return {
            "checkpoint_every": checkpoint_every,
            "rounds_behind": at_start,
            "rounds_replayed": len(replayed),
            "replay_bytes_down": bytes_down,
            "checkpoint_bytes": checkpoint,
            "seconds_to_first_contribution": seconds,
        }
    finally:
        cluster.stop()


def _recovery(root: Path, store: EmbeddedStore, kill_at: int) -> dict:
    run = _run(kill_at + 8, 0)
    cluster = Cluster(root, store, run, 3)
    try:
        cluster.start_coordinator()
        for name in cluster.tokens:
            cluster.start_node(name)
        cluster.wait_closed(kill_at)
        victim = cluster.nodes["node-1"]
        victim.kill()
        killed_during = cluster.status().round
        cluster.start_node("node-1")

        def back(s: StatusView) -> bool:
            return any(
                "node-1" in r.gather and r.round > killed_during
                for r in s.rounds
                if r.state == RoundState.CLOSED
            )

        status = cluster.wait_for("node-1 back in a gather set", back)
        first_back = min(
            r.round
            for r in status.rounds
            if r.state == RoundState.CLOSED and "node-1" in r.gather and r.round > killed_during
        )
        cluster.wait_finished()
        return {
            "killed_during_round": killed_during,
            "back_in_round": first_back,
            "rounds_to_recover": first_back - killed_during,
        }
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--behind", type=int, default=50)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with EmbeddedStore(root / "store") as store:
            results = {
                "replay": _late_join(root / "replay", store, args.behind, 0),
                "checkpoint": _late_join(root / "ckpt", store, args.behind, args.behind),
                "recovery": _recovery(root / "recovery", store, 5),
            }
    print(json.dumps(results, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
