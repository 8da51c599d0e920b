"""The operator's guide (docs/operators-guide.md), command for command, with real processes.

A new operator on one machine: starts the store (``sparseloco store``), writes ``run.toml`` from
``deploy/run.example.toml``, starts ``sparseloco coordinator --config run.toml``, invites two
participants with ``sparseloco coordinator token add``, who check their machine with
``sparseloco doctor`` and run ``sparseloco node``; while the run goes on the operator adds a
third participant and revokes one, then watches the dashboard, and at the end exports the model
with ``sparseloco export``. Every command is the console script a user types, run as its own
process; what is asserted is what those commands print and do.

(Outages are the chaos suite's ``test_chaos_outage.py``; the dashboard in a real browser is
``test_dashboard.py``.)
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
from safetensors.torch import load_file

from node.cluster.process import Process
from node.cluster.seaweed import free_ports
from protocol.fingerprint import fingerprint
from protocol.invite import decode_invite
from protocol.messages import MemberState, RoundState
from protocol.status import StatusView

REPO = Path(__file__).resolve().parent.parent
SPARSELOCO = str(Path(sys.executable).parent / "sparseloco")
WAIT_S = 240.0

T = TypeVar("T")


class Operator:
    """A shell session: a working folder, an environment, and the processes started from it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            NUMBA_NUM_THREADS="1",
            AWS_ACCESS_KEY_ID="operator",
            AWS_SECRET_ACCESS_KEY=secrets.token_hex(20),
        )
        self.env.pop("SPARSELOCO_NODE_TOKEN", None)
        self.procs: list[Process] = []

    def run(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [SPARSELOCO, *args],
            cwd=self.root,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=WAIT_S,
            check=False,
        )

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> Process:
        proc = Process(
            name,
            [SPARSELOCO, *args],
            self.root / "logs" / f"{name}.log",
            env={**self.env, **(env or {})},
            cwd=self.root,
        )
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout=20)


@pytest.fixture
def operator(tmp_path: Path) -> Iterator[Operator]:
    op = Operator(tmp_path)
    yield op
    op.stop_all()


def _wait(what: str, check: Callable[[], T], procs: Sequence[Process] = ()) -> T:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() not in (None, 0):
                raise AssertionError(f"{p.name} exited with {p.poll()}:\n{p.tail(30)}")
        result = check()
        if result:
            return result
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _status(url: str) -> StatusView:
    with urllib.request.urlopen(f"{url}/v1/status?rounds=1000", timeout=10) as resp:
        return StatusView.model_validate_json(resp.read())


def _edit(text: str, old: str, new: str) -> str:
    """One line of the example config changed, as the operator would in an editor."""
    assert text.count(old) == 1, f"deploy/run.example.toml no longer has exactly one {old!r}"
    return text.replace(old, new)


def test_an_operator_runs_a_multi_party_run_from_the_readme(operator: Operator) -> None:
    op = operator
    (s3_port,) = free_ports(1)

    # 1. The store: one machine, every port on loopback.
    store = op.start("store", "store", "--dir", "store-data", "--port", str(s3_port))
    _wait("the store", lambda: "store ready" in store.output(), [store])

    # 2. The coordinator's config, from the example.
    text = (REPO / "deploy" / "run.example.toml").read_text()
    # Rounds of a few seconds, enough of them for a node to join and another to be revoked.
    text = _edit(text, "\nrounds = 20 ", "\nrounds = 10 ")
    text = _edit(text, "inner_steps = 30 ", "inner_steps = 150 ")
    text = _edit(text, "min_nodes = 1 ", "min_nodes = 2 ")
    text = _edit(text, "checkpoint_every = 10 ", "checkpoint_every = 2 ")
    text = _edit(text, "port = 8700 ", "port = 0 ")
    text = _edit(
        text,
        '\nendpoint_url = "http://127.0.0.1:8333"',
        f'\nendpoint_url = "http://127.0.0.1:{s3_port}"',
    )
    (op.root / "run.toml").write_text(text)
    secrets_env = {
        "SPARSELOCO_COORD_STORAGE__ACCESS_KEY": op.env["AWS_ACCESS_KEY_ID"],
        "SPARSELOCO_COORD_STORAGE__SECRET_KEY": op.env["AWS_SECRET_ACCESS_KEY"],
    }
    op.env.update(secrets_env)

    # 3. First thing against a new store: what it keeps of the project's promises.
    checked = op.run("store", "check", "--config", "run.toml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "a coordinator would start: every promise is kept" in checked.stdout
    assert op.env["AWS_SECRET_ACCESS_KEY"] not in checked.stdout + checked.stderr

    # 4. Start it; it checks the store before it writes anything.
    coordinator = op.start("coordinator", "coordinator", "--config", "run.toml")
    announce = op.root / "coordinator-state" / "coordinator.json"

    def announced() -> str | None:
        return json.loads(announce.read_text())["url"] if announce.exists() else None

    url = str(_wait("the coordinator", announced, [coordinator]))

    # 5. Invite two participants: one with a bare token, one with an invite (URL, token and the
    # manifest key's fingerprint in one string).
    added = op.run("coordinator", "token", "add", "node-a", "--config", "run.toml")
    assert added.returncode == 0, added.stderr
    tokens = {"node-a": added.stdout.strip()}
    assert re.fullmatch(r"\S{20,}", tokens["node-a"]), added.stdout
    invited = op.run(
        "coordinator", "token", "add", "node-b", "--config", "run.toml", "--invite", "--url", url
    )
    assert invited.returncode == 0, invited.stderr
    invite = invited.stdout.strip()
    assert invite.startswith("sparseloco-invite:v1:"), invited.stdout
    tokens["node-b"] = decode_invite(invite).token
    listed = op.run("coordinator", "token", "list", "--config", "run.toml")
    assert listed.returncode == 0 and "node-a" in listed.stdout and "node-b" in listed.stdout
    assert not any(t in listed.stdout + listed.stderr for t in tokens.values())

    # 6. Participants check their machine, then run a node.
    participant = {"SPARSELOCO_NODE_COORDINATOR": url}

    def as_node(token: str) -> dict[str, str]:
        return {**participant, "SPARSELOCO_NODE_TOKEN": token}

    doctor = op.run("doctor", env=as_node(tokens["node-a"]))
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert re.search(r"ok\s+store\s+presigned PUT and GET", doctor.stdout), doctor.stdout
    with_invite = {"SPARSELOCO_NODE_INVITE": invite}
    doctor = op.run("doctor", env=with_invite)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert tokens["node-b"] not in doctor.stdout + doctor.stderr
    nodes = {
        "node-a": op.start(
            "node-a", "node", "--state-dir", "nodes/node-a", "--threads", "1",
            env=as_node(tokens["node-a"]),
        ),
        "node-b": op.start(
            "node-b", "node", "--state-dir", "nodes/node-b", "--threads", "1", env=with_invite
        ),
    }  # fmt: skip

    def round_closed() -> bool:
        return any(r.state == RoundState.CLOSED for r in _status(url).rounds)

    _wait("round 0 to close", round_closed, [*nodes.values(), coordinator])
    assert "event=manifest_key_pinned node=node-b source=invite" in nodes["node-b"].output()

    # 6. While it runs: a third participant joins, and one is revoked.
    added = op.run("coordinator", "token", "add", "node-c", "--config", "run.toml")
    assert added.returncode == 0, added.stderr
    tokens["node-c"] = added.stdout.strip()
    nodes["node-c"] = op.start(
        "node-c", "node", "--state-dir", "nodes/node-c", "--threads", "1",
        env=as_node(tokens["node-c"]),
    )  # fmt: skip
    revoked = op.run("coordinator", "token", "revoke", "node-b", "--config", "run.toml")
    assert revoked.returncode == 0, revoked.stderr
    code = _wait("node-b to stop", lambda: nodes["node-b"].poll(), [coordinator])
    assert code == 2 and "revoked" in nodes["node-b"].tail(5), nodes["node-b"].tail(20)

    # 7. The run finishes by itself; the survivors exit 0 and agree.
    def finished() -> StatusView | None:
        s = _status(url)
        return s if s.state == RoundState.FINISHED else None

    _wait("the run to finish", finished, [nodes["node-a"], nodes["node-c"], coordinator])
    for n in ("node-a", "node-c"):
        proc = nodes[n]
        _wait(f"{n} to exit", lambda proc=proc: proc.poll() is not None)  # type: ignore[misc]
        assert proc.poll() == 0, proc.tail(20)
        assert "event=run_finished" in nodes[n].output()
    final = _status(url)  # with the last reports, sent before the nodes exited
    states = {m.node_id: m.state for m in final.members}
    assert states == {
        "node-a": MemberState.FINISHED,
        "node-b": MemberState.REVOKED,
        "node-c": MemberState.FINISHED,
    }
    last = final.rounds[-1]
    assert len(set(last.fingerprints.values())) == 1
    assert "node-c" in {g for r in final.rounds for g in r.gather}

    # 8. The dashboard answers at the coordinator's URL.
    with urllib.request.urlopen(url + "/", timeout=10) as resp:
        assert resp.status == 200 and b"<html" in resp.read().lower()

    # 9. Export the model, verified against the fingerprint the nodes agreed on.
    out = op.run("export", "--out", "model", env=as_node(tokens["node-a"]))
    assert out.returncode == 0, out.stdout + out.stderr
    meta = json.loads((op.root / "model" / "run.json").read_text())
    assert meta["round"] == final.run.rounds and meta["run"]["model"] == "tiny"  # 10 % 2 == 0
    tensors = load_file(str(op.root / "model" / "model.safetensors"))
    assert fingerprint(tensors) == meta["fingerprint"] == next(iter(last.fingerprints.values()))

    # 10. Stop the coordinator and the store cleanly.
    coordinator.send_signal(signal.SIGTERM)
    _wait("the coordinator to stop", lambda: coordinator.poll() is not None)
    assert coordinator.poll() == 0, coordinator.tail(20)
    store.stop()
    shutil.rmtree(op.root / "store-data", ignore_errors=True)
