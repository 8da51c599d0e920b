"""A node of several processes (``node.compute.ranks``, ``node.daemon.ranks``).

The unit test runs the real leader and follower of ``node.compute.ranks`` in two processes
(spawned, gloo on loopback) and checks that two rounds of their inner steps give the parameters
one process gets from the same full batches; the integration test runs a 2-process torchrun node
beside an ordinary one against a real coordinator and store.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from node.compute.presets import get_run_preset
from node.compute.ranks import Follower, Kind, Ranks, lead
from node.compute.state import restore_adam
from node.compute.worker import Worker
from node.errors import Abandoned, RanksError
from protocol.messages import RoundState
from protocol.runconfig import RunConfig, Timing
from support.cluster import Cluster

#: batch_size 5 over 2 processes: rows 3 and 2, so the weighting by rows matters.
RUN = RunConfig(name="ranks", model="tiny", rounds=2, inner_steps=4, batch_size=5, min_nodes=1)
#: A factor the leader's lr_scale returns, which the followers must use too.
LR_SCALE = 0.7


def _worker() -> Worker:
    return Worker(RUN, run_id="ranks", node_id="n", slot=3)


def _params(worker: Worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.inner.model.named_parameters()}


def _two_rounds(train) -> list[float]:
    """Round 0, AdamW reset (as a restore from disk does: the followers must get it), round 1;
    training goes on from the parameters round 0 left."""
    losses = train(0)
    return losses + train(1)


def _rank_main(rank: int, world: int, init_file: str, outs: list[str]) -> None:
    out = outs[rank]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    ranks = Ranks.from_env(init_method=f"file://{init_file}")
    try:
        if rank != 0:
            follower = Follower(ranks)
            assert follower.serve() == 0
            assert follower.loop is not None
            torch.save({n: p.data for n, p in follower.loop.model.named_parameters()}, out)
            return
        worker = _worker()
        loop = lead(worker.inner, ranks)
        stopped = threading.Event()
        stopped.set()
        try:  # a stop before the first step: every rank leaves the round
            loop.train(0, lr_scale=lambda: LR_SCALE, stop=stopped)
            raise AssertionError("not abandoned")
        except Abandoned:
            pass

        def train(round_: int) -> list[float]:
            if round_ == 1:
                restore_adam(loop.opt, {})
            return loop.train(round_, lr_scale=lambda: LR_SCALE, stop=threading.Event())

        losses = _two_rounds(train)
        ranks.send(Kind.STOP)
        torch.save({"params": _params(worker), "losses": losses}, out)
    finally:
        ranks.close()


def _spawn(
    child: Callable[[int, int, str, list[str]], None], tmp_path: Path
) -> tuple[list[str], list[int | None]]:
    """Run ``child(rank, 2, init_file, outs)`` in two spawned processes (each runs to its own
    end: none is torn down when another fails); their output files and exit codes."""
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    spawn = mp.get_context("spawn")
    procs = [
        spawn.Process(target=child, args=(r, 2, str(tmp_path / "init"), outs)) for r in range(2)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 120
    try:
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(proc.is_alive() for proc in procs), "the ranks did not finish"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return outs, [proc.exitcode for proc in procs]


def test_two_processes_train_what_one_process_trains(tmp_path: Path) -> None:
    outs, codes = _spawn(_rank_main, tmp_path)
    assert codes == [0, 0]
    leader = torch.load(outs[0])
    follower = torch.load(outs[1])

    reference = _worker()

    def train(round_: int) -> list[float]:
        if round_ == 1:
            restore_adam(reference.opt, {})
        return reference.inner.train(round_, lr_scale=lambda: LR_SCALE, stop=threading.Event())

    expected_losses = _two_rounds(train)
    expected = _params(reference)
    initial = _params(_worker())
    assert leader["losses"] == pytest.approx(expected_losses, rel=1e-5)
    assert set(leader["params"]) == set(expected)
    for name, value in expected.items():
        assert not torch.equal(value, initial[name]), name  # it trained
        torch.testing.assert_close(leader["params"][name], value, rtol=1e-5, atol=1e-6)
        # Every rank took the very same steps: the follower holds rank 0's bits.
        assert torch.equal(follower[name], leader["params"][name]), name


def _dying_follower_child(rank: int, world: int, init_file: str, outs: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    ranks = Ranks.from_env(init_method=f"file://{init_file}")
    if rank != 0:
        assert ranks.receive()[0] is Kind.SETUP
        ranks.objects([None] * 4)
        os._exit(3)  # dies without a word, as a crash or an OOM kill would
    loop = lead(_worker().inner, ranks)
    try:
        loop.train(0, lr_scale=lambda: 1.0, stop=threading.Event())
    except RanksError as exc:
        Path(outs[0]).write_text(str(exc))


def test_a_follower_that_dies_fails_rank_0_with_a_clear_error(tmp_path: Path) -> None:
    outs, codes = _spawn(_dying_follower_child, tmp_path)
    assert codes == [0, 3]
    message = Path(outs[0]).read_text()
    assert "the node's processes lost each other" in message
    assert "Another rank exited or hung" in message


TIMING = Timing(first_round_s=120, min_round_s=60, max_round_s=120, heartbeat_timeout_s=30)


def _rank_pids(log: str) -> dict[int, int]:
    """rank -> pid of the processes a torchrun node logged (the latest start of each rank)."""
    found = re.findall(r"event=rank_ready rank=(\d+) world=\d+ backend=\S+ pid=(\d+)", log)
    return {int(rank): int(pid) for rank, pid in found}


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def test_a_two_process_node_takes_part_like_any_other(tmp_path: Path, store) -> None:
    # The tiny preset's shape; min_nodes=2 keys the scenario to rounds: the run waits while the
    # torchrun node is away. It trains rounds 0-1 beside an ordinary node, is stopped with
    # SIGTERM (all its processes end), comes back from its state and finishes the run.
    shape = get_run_preset("tiny")
    run = RunConfig(
        name="ranks", model=shape.model, rounds=4, inner_steps=shape.inner_steps,
        batch_size=shape.batch_size, min_nodes=2, timing=TIMING,
    )  # fmt: skip
    cluster = Cluster(tmp_path, store, run, 2)
    try:
        cluster.start_coordinator()
        ranked = cluster.start_node("node-0", ranks=2)
        cluster.start_node("node-1")
        status = cluster.wait_closed(2)
        first = _rank_pids(ranked.output())
        assert set(first) == {0, 1}, ranked.tail(40)
        assert "event=rank_setup rank=1" in ranked.output()

        ranked.stop()  # SIGTERM to torchrun, which passes it on to both ranks
        log = ranked.output()
        assert "event=rank_stopped rank=1" in log, log[-3000:]
        assert "event=stop_requested node=node-0" in log
        assert all(_gone(pid) for pid in first.values())

        ranked = cluster.start_node("node-0", ranks=2)
        status = cluster.wait_finished()  # both exit 0: rank 0 stops its follower at the end
        second = _rank_pids(ranked.output())
        assert set(second) == {0, 1} and not set(second.values()) & set(first.values())
        assert all(_gone(pid) for pid in second.values())
    finally:
        cluster.stop()
    closed = [r for r in status.rounds if r.state == RoundState.CLOSED]
    assert [r.round for r in closed] == list(range(run.rounds))
    both = {"node-0", "node-1"}
    for summary in closed:
        # Every node that reported a round reports the same θ after it.
        assert len(set(summary.fingerprints.values())) == 1, summary.fingerprints
    # The torchrun node's payloads are gathered and aggregated like the other's.
    assert set(closed[0].gather) == both and set(closed[1].gather) == both
    assert set(closed[-1].gather) == both and set(closed[-1].fingerprints) == both
