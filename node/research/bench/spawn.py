"""Run a function on every rank of a node of N processes (spawned, gloo on loopback).

What ``torchrun`` does for a real node, in miniature, for benchmarks and tests: ``spawn(world,
child, out, *args)`` starts ``world`` processes; each joins the process group as torchrun would
describe it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, a ``file://`` rendezvous beside ``out``)
and calls ``child(group, out, *args)``. Children write their results into ``out`` (JSON or
safetensors: nothing is unpickled from them) and each runs to its own end, so one failing rank
does not hide another's error. Returns the exit codes.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

#: Safety net for one spawned node.
WAIT_S = 3600.0


def _main(
    rank: int,
    world: int,
    init: str,
    out: str,
    threads: int,
    child: Callable[..., None],
    args: tuple[Any, ...],
    plain: bool = False,
) -> None:
    import torch

    from node.compute.group import Group
    from node.compute.heap import return_large_blocks

    return_large_blocks()  # as ``sparseloco node`` does
    import numba

    # The codec's compiled loops get the same threads (``sparseloco up`` sets
    # NUMBA_NUM_THREADS likewise): ranks on shared cores do not oversubscribe them. numba first:
    # starting its pool sets this thread's OpenMP count, torch's too (``protocol.kernels``).
    numba.set_num_threads(min(threads, int(getattr(numba.config, "NUMBA_NUM_THREADS", threads))))
    torch.set_num_threads(threads)
    if plain:  # a plain process, as ``sparseloco node`` without torchrun runs
        group = Group.solo()
    else:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        group = Group.from_env(init_method=f"file://{init}")
    try:
        child(group, Path(out), *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        group.close()


def spawn(
    world: int,
    child: Callable[..., None],
    out: Path,
    *args: Any,
    threads: int = 1,
    wait_s: float = WAIT_S,
    plain: bool = False,
) -> list[int | None]:
    """Run ``child(group, out, *args)`` on ``world`` ranks (``threads`` torch threads each);
    their exit codes. ``plain`` (``world`` 1 only): one process without a process group, as
    ``sparseloco node`` runs without torchrun (``Group.solo()``)."""
    if plain and world != 1:
        raise ValueError("a plain process is a node of one rank")
    out.mkdir(parents=True, exist_ok=True)
    init = out.parent / f".rendezvous-{os.getpid()}-{time.monotonic_ns()}"
    context = mp.get_context("spawn")
    procs = [
        context.Process(
            target=_main, args=(r, world, str(init), str(out), threads, child, args, plain)
        )
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + wait_s
    try:
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(proc.is_alive() for proc in procs):
            raise TimeoutError(f"the {world} ranks did not finish in {wait_s:.0f} s")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        init.unlink(missing_ok=True)
    return [proc.exitcode for proc in procs]
