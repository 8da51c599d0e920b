"""Wait for the docker-compose run to finish and check that its nodes agree.

Called by ``deploy/compose-test.sh`` once ``docker-compose up -d`` has started the store, the
coordinator and the nodes. It polls the coordinator's ``GET /v1/status`` (published on the
host's loopback) and each node container's state, and succeeds only when:

- the run reached its last round (``state == "finished"``) and every node container exited
  with status 0 without ever being restarted;
- every round of the run is closed, and each closed round carries a fingerprint from every
  node, all of them identical.

It fails at once, naming the reason, when a node exits non-zero or restarts, the coordinator
stops answering, or the time limit passes. ``--status-file`` checks only the second point, on
a status body saved elsewhere (the run of the systemd units). Standard library only: it runs on
the host's ``python3``, outside the project's virtual environment. Exit status 0 on success.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

#: Seconds between two polls.
POLL_S = 2.0
#: Seconds the coordinator may fail to answer in a row before the check gives up.
UNREACHABLE_S = 30.0


#: What ``docker inspect`` prints of a container: status, exit code, restart count.
INSPECT_FORMAT = "{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}"


class CheckFailed(Exception):
    """The run did not do what it should; the message says what."""


@dataclass(frozen=True)
class Container:
    service: str
    status: str  # created, running, exited, restarting...
    exit_code: int
    restarts: int


def containers(docker: str, project: str, service: str) -> list[Container]:
    """The containers of ``service`` in compose project ``project`` (by compose's labels)."""
    ids = subprocess.run(
        [
            docker,
            "ps",
            "-aq",
            "--filter",
            f"label=com.docker.compose.project={project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.split()
    found = []
    for cid in ids:
        out = subprocess.run(
            [docker, "inspect", "-f", INSPECT_FORMAT, cid],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
        found.append(Container(service, out[0], int(out[1]), int(out[2])))
    return found


def fetch_status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/v1/status?rounds=1000", timeout=10) as resp:
        status: dict[str, Any] = json.load(resp)
        return status


def wait_for_run(
    url: str, docker: str, project: str, nodes: list[str], timeout_s: float
) -> dict[str, Any]:
    """Poll until the run finished and every node exited 0; the final status."""
    deadline = time.monotonic() + timeout_s
    last_ok = time.monotonic()
    last_line = ""
    while True:
        try:
            status = fetch_status(url)
            last_ok = time.monotonic()
        except (urllib.error.URLError, OSError) as exc:
            if time.monotonic() - last_ok > UNREACHABLE_S:
                raise CheckFailed(f"the coordinator at {url} stopped answering: {exc}") from exc
            status = None
        states = {}
        for node in nodes:
            found = containers(docker, project, node)
            if len(found) != 1:
                raise CheckFailed(f"expected one container of {node}, found {len(found)}")
            box = found[0]
            if box.restarts:
                raise CheckFailed(f"{node} was restarted {box.restarts} time(s): it crashed")
            if box.status == "exited" and box.exit_code != 0:
                raise CheckFailed(f"{node} exited with status {box.exit_code}")
            states[node] = box.status
        if status is not None:
            closed = sum(1 for r in status["rounds"] if r["state"] == "closed")
            line = f"round {status['round']} {status['state']}; {closed} closed; " + ", ".join(
                f"{n} {s}" for n, s in states.items()
            )
            if line != last_line:
                print(f"  {line}", flush=True)
                last_line = line
            if status["state"] == "finished" and all(s == "exited" for s in states.values()):
                return fetch_status(url)  # after the nodes' last reports
        if time.monotonic() > deadline:
            raise CheckFailed(f"the run did not finish within {timeout_s:.0f} s ({last_line})")
        time.sleep(POLL_S)


def check_agreement(status: dict[str, Any], nodes: list[str]) -> list[str]:
    """Check every round closed with one fingerprint from all nodes; summary lines."""
    run = status["run"]
    closed = [r for r in status["rounds"] if r["state"] == "closed"]
    if len(closed) != run["rounds"]:
        raise CheckFailed(f"{len(closed)} rounds closed, the run has {run['rounds']}")
    lines = [f"{'round':>5}  {'gather':<16} {'fingerprint':<14} {'eval loss':>9}  excluded"]
    for r in closed:
        fps = r["fingerprints"]
        missing = sorted(set(nodes) - set(fps))
        if missing:
            raise CheckFailed(f"round {r['round']}: no fingerprint from {', '.join(missing)}")
        if len(set(fps.values())) != 1:
            raise CheckFailed(f"round {r['round']}: the nodes disagree: {fps}")
        reports = r["reports"].values()
        losses = [rep["eval_loss"] for rep in reports if rep.get("eval_loss") is not None]
        loss = f"{sum(losses) / len(losses):9.4f}" if losses else f"{'-':>9}"
        excluded = ", ".join(f"{n} ({why})" for n, why in r["excluded"].items()) or "-"
        gather = ",".join(r["gather"])
        fp = next(iter(fps.values()))[:12]
        lines.append(f"{r['round']:>5}  {gather:<16} {fp:<14} {loss}  {excluded}")
    checkpoint = status.get("checkpoint")
    if checkpoint:
        lines.append(
            f"checkpoint: round {checkpoint['round']} by {checkpoint['node_id']},"
            f" {checkpoint['size']} bytes"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="the coordinator as published on the host")
    p.add_argument("--project", help="the compose project name")
    p.add_argument("--nodes", default="node-a,node-b", help="node ids, comma-separated")
    p.add_argument("--docker", default="docker", help="the docker client")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument(
        "--status-file",
        help="only check this saved GET /v1/status body (- for stdin): no waiting, no containers",
    )
    args = p.parse_args(argv)
    nodes = args.nodes.split(",")
    t0 = time.monotonic()
    try:
        if args.status_file:
            with open(args.status_file if args.status_file != "-" else 0) as f:
                status = json.load(f)
        elif args.url and args.project:
            status = wait_for_run(args.url, args.docker, args.project, nodes, args.timeout)
        else:
            p.error("give --url and --project, or --status-file")
        lines = check_agreement(status, nodes)
    except CheckFailed as exc:
        print(f"compose check failed: {exc}", file=sys.stderr)
        return 1
    print(f"run {status['run_id']}: {len(nodes)} nodes, checked in {time.monotonic() - t0:.0f} s")
    for line in lines:
        print(f"  {line}")
    print(f"fingerprints identical on {', '.join(nodes)} in every round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
