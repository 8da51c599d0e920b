"""What an operator reads while the object store is down: one line when it stops answering, one
when it is back, short, with the cause in words.

Real processes: a store of the test's own (SeaweedFS, stopped and started again without
disturbing other tests), a coordinator and two nodes on the tiny model. After two rounds the
store stops; once both nodes noticed (and a third joins, so it meets the outage while it looks
for a checkpoint), it stays down a few more seconds, then comes back, and the run finishes.
Asserted on the log files, as a person would read them: per node exactly one
``event=unreachable service=store`` and one ``event=reachable service=store``; no line blames
the coordinator or calls a checkpoint bad; no exception repr; messages under 180 characters.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from node.cluster.seaweed import EmbeddedStore
from protocol.runconfig import RunConfig, Timing
from support.cluster import Cluster

TIMING = Timing(first_round_s=120, min_round_s=60, max_round_s=120, heartbeat_timeout_s=30)
RUN = RunConfig(
    name="outage-logs",
    model="tiny",
    rounds=6,
    inner_steps=5,
    batch_size=4,
    min_nodes=2,
    checkpoint_every=2,
    timing=TIMING,
)
#: Seconds the store stays down after both nodes noticed (a few of their retries).
HELD_S = 8.0
#: Safety net for the nodes to notice the outage; they do within a second or two.
NOTICE_S = 120.0
REPRS = ("ClientConnectorError(", "ConnectionKey(", "RetriesExhausted(", "TransientError(")
#: Longest message a person reads (after the time, the level and the logger's name).
MAX_MESSAGE = 180
#: The one long line of a first join: the full manifest key fingerprint, to compare by eye.
EXEMPT = "event=manifest_key_pinned"


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _noticed(path: Path) -> bool:
    return path.exists() and "event=unreachable service=store" in path.read_text()


def test_a_store_outage_reads_as_two_short_lines_per_node(tmp_path: Path) -> None:
    store = EmbeddedStore(tmp_path / "store")
    store.start()
    cluster = Cluster(tmp_path, store, RUN, nodes=3)
    logs = tmp_path / "logs"
    try:
        cluster.start_coordinator()
        cluster.start_node("node-0")
        cluster.start_node("node-1")
        cluster.wait_closed(2)
        # A joiner starts from the newest checkpoint, so one must be committed before the outage.
        deadline = time.monotonic() + NOTICE_S
        while "event=checkpoint_committed" not in _text(logs / "coordinator-1.log"):
            assert time.monotonic() < deadline, "no checkpoint was committed"
            time.sleep(0.2)
        store.stop()
        cluster.start_node("node-2")  # a new joiner: its checkpoint download meets the outage
        deadline = time.monotonic() + NOTICE_S
        # The joiner meets the outage at once; of the two members, one that already submitted
        # may wait for the round's manifest without touching the store until it is back (the
        # coordinator holds the round open meanwhile), so it need not notice.
        members = (logs / "node-0.log", logs / "node-1.log")
        while not (_noticed(logs / "node-2.log") and any(map(_noticed, members))):
            assert time.monotonic() < deadline, "the nodes never noticed the outage"
            time.sleep(0.5)
        time.sleep(HELD_S)
        store.start()
        cluster.wait_finished()
    finally:
        cluster.stop()
        store.stop()

    for i in range(3):
        text = (logs / f"node-{i}.log").read_text()
        where = f"node-{i}:\n{text[-3000:]}"
        downs = text.count("event=unreachable service=store")
        assert downs == text.count("event=reachable service=store"), where
        assert downs == 1 or (downs == 0 and i < 2), where
        if downs == 0:
            _readable(text, where)
            continue
        down = next(x for x in text.splitlines() if "event=unreachable service=store" in x)
        # The cause in words ("connection refused by 127.0.0.1:8333", "the server closed the
        # connection" when it stopped mid-transfer), never a repr.
        assert re.search(r"since=\d\d:\d\d:\d\d what='[^']+' cause='[^'(]+' ", down), down
        assert "next_try_" in down
        assert "service=coordinator" not in text, where  # the coordinator never stopped
        assert "checkpoint_rejected" not in text and "checkpoint_failed" not in text, where
        _readable(text, where)
    # The joiner starts from the checkpoint it met the outage on: its download is retried until
    # the store is back (or, after the retries' budget, it waits with ``why=store_unreachable``,
    # depending on how long the outage lasts), never rejected and never passed over.
    joiner = (logs / "node-2.log").read_text()
    assert "event=checkpoint_loaded node=node-2" in joiner, joiner[-3000:]
    waits = re.findall(r"event=checkpoint_waiting node=node-2 (why=\S+)", joiner)
    assert set(waits) <= {"why=store_unreachable"}, waits
    coordinator = (logs / "coordinator-1.log").read_text()
    downs = coordinator.count("event=unreachable service=store")
    assert downs <= 1 and downs == coordinator.count("event=reachable service=store")
    _readable(coordinator, "coordinator")


def _readable(text: str, where: str) -> None:
    for line in text.splitlines():
        assert not any(r in line for r in REPRS), f"{where}: {line}"
        message = re.sub(r"^\S+ \S+ [A-Z]+ \S+ ", "", line)
        if EXEMPT not in line:
            assert len(message) < MAX_MESSAGE, f"{where}: {len(message)} characters: {line}"
