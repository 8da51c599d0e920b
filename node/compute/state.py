"""The node's local state on disk: what a restart needs to continue exactly where it stopped.

Safetensors files, each written to a temporary name straight from the tensors' memory, fsynced,
renamed over the old one, the directory fsynced (``node.compute.files``), so a crash at any
instant leaves a file either whole or not there:

- ``state.safetensors``: the commit point. Rank 0's part of the error-feedback buffer e, and in
  its metadata the JSON header (run id, node id, round, phase, θ's fingerprint, inner steps,
  mass, the node's rank count ``world`` and the commit's sequence number ``seq``);
- ``error-{seq}.rank{k}.safetensors``: rank k's part of e for that commit (k > 0 only);
- ``theta-{round}.safetensors``: θ_round (the tensors this rank owns; ``.rank{k}`` before the
  suffix on a node of several ranks), with θ's fingerprint;
- ``adam-{round}.safetensors``: this rank's AdamW moments after training round ``round``.

Every rank saves its own tensors (``node.compute.sharding``): no process writes or holds the
whole model. A commit is two-phase: every rank k > 0 writes its part of e under the new
sequence number, the ranks wait for each other, rank 0 writes ``state.safetensors``, the ranks
wait again, and only then does each delete its files of older commits; a crash anywhere leaves
the previous commit and every file it names. A node of one process writes exactly one file per
kind, with no rank suffix.

Reading a state back, under the same rank count or another, is ``node.compute.stateread``.

Phases:

- ``idle``: θ is θ_round; nothing of round ``round`` has been computed yet.
- ``submitting``: round ``round`` was trained from θ_round and compressed; e already has ĉ
  subtracted and ``pending-{round}.slc`` (rank 0, written first, also atomically) holds the
  payload, so a restart re-sends the very same bytes instead of training again.

What is on a round's critical path (measured by ``node.research.bench.node_work``): after
applying round r-1, θ_r is written behind while the node evaluates and trains round r
(training works on a copy of θ, so θ_r's memory stays still until round r is applied; every
method that changes θ waits for the write); after training round r, the payload, then the
commit (e and the header: 4 B/param) on the path; AdamW's moments are written behind, and the
next training waits for them. Applying the aggregate writes nothing: θ_{r+1} and the settled e
follow from the state saved after training and round r's signed manifest and payloads, which is
exactly what a restart does (it finishes round r again, as a late joiner replays it). ``idle``
is written whole when the node did not train (catch-up, a resync, a checkpoint, the run's end).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open

from node.compute.files import fsync_write, write_safetensors
from node.compute.group import Group

STATE_FILE = "state.safetensors"
#: The payload of a round being submitted: ``pending-{round}.slc``.
PENDING_PATTERN = "pending-{}.slc"
THETA_PATTERN = "theta-{}.safetensors"
ADAM_PATTERN = "adam-{}.safetensors"
#: Rank k > 0's part of e for commit ``seq`` (always with the rank suffix).
ERROR_PATTERN = "error-{}.safetensors"
#: 3: fingerprints of version 2 (``protocol.fingerprint``), ranks and resharding. A state of
#: an earlier version is set aside like a damaged one; the node recovers from the store.
STATE_VERSION = 3
_RANKED = re.compile(r"\.rank(\d+)\.safetensors$")

Phase = Literal["idle", "submitting"]


@dataclass
class NodeState:
    """Everything a node (this rank's share of it) keeps between rounds."""

    run_id: str
    node_id: str
    round: int
    theta: dict[str, torch.Tensor]
    error: dict[str, torch.Tensor]
    adam: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Inner steps taken with the current AdamW state (drives the re-warm-up).
    local_steps: int = 0
    phase: Phase = "idle"
    fingerprint: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    #: The node's rank count when this was saved, and the commit's sequence number.
    world: int = 1
    seq: int = 0


def shard_file(pattern: str, key: object, rank: int = 0, world: int = 1) -> str:
    """The file name of ``pattern`` for ``key`` (a round, a seq) written by ``rank`` of
    ``world``: the plain name for one process, ``.rank{k}`` before the suffix otherwise."""
    name = pattern.format(key)
    if world > 1 or pattern == ERROR_PATTERN:
        name = name.replace(".safetensors", f".rank{rank}.safetensors")
    return name


def pending_path(state_dir: Path, round_: int) -> Path:
    return state_dir / PENDING_PATTERN.format(round_)


def save_pending(state_dir: Path, round_: int, payload: bytes) -> None:
    """Atomically store the payload of round ``round_``, which is being submitted (rank 0).

    Named by round: the state file on disk may still describe the previous round's payload
    until the new state replaces it, so the two must not share a file.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    fsync_write(pending_path(state_dir, round_), payload)


def load_pending(state_dir: Path, round_: int) -> bytes | None:
    """The stored payload of round ``round_``, or None."""
    path = pending_path(state_dir, round_)
    return path.read_bytes() if path.exists() else None


def clear_pending(state_dir: Path, keep: int | None = None) -> None:
    """Delete stored payloads but round ``keep``'s (after a state that no longer needs them)."""
    for path in state_dir.glob(PENDING_PATTERN.format("*")):
        if keep is None or path.name != PENDING_PATTERN.format(keep):
            path.unlink(missing_ok=True)


def numbered_files(state_dir: Path, pattern: str, rank: int, world: int) -> dict[int, Path]:
    """This rank's files of ``pattern`` in ``state_dir`` by their number."""
    prefix = pattern.split("{}")[0]
    suffix = shard_file(pattern, "", rank, world)[len(prefix) :]
    out = {}
    for path in state_dir.glob(prefix + "*" + suffix):
        number = path.name[len(prefix) : len(path.name) - len(suffix)]
        if number.isdigit():
            out[int(number)] = path
    return out


@dataclass(frozen=True)
class RankFiles:
    """The files of ``rank`` of ``world`` in a node's ``state_dir`` (named by ``shard_file``)."""

    state_dir: Path
    rank: int = 0
    world: int = 1

    @classmethod
    def of(cls, state_dir: Path, group: Group) -> RankFiles:
        """The files of ``group``'s rank."""
        return cls(state_dir, group.rank, group.world)

    def path(self, pattern: str, key: object) -> Path:
        """This rank's file of ``pattern`` for ``key``."""
        return self.state_dir / shard_file(pattern, key, self.rank, self.world)


def save_theta(files: RankFiles, round_: int, theta: Mapping[str, torch.Tensor], fp: str) -> None:
    """θ_round (this rank's tensors) with the node's fingerprint of it."""
    files.state_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(
        files.path(THETA_PATTERN, round_), theta, {"round": str(round_), "fingerprint": fp}
    )


def save_adam(
    files: RankFiles, round_: int, adam: Mapping[str, torch.Tensor], local_steps: int
) -> None:
    """This rank's AdamW moments; its older ones are deleted after it."""
    files.state_dir.mkdir(parents=True, exist_ok=True)
    meta = {"round": str(round_), "local_steps": str(local_steps), "world": str(files.world)}
    write_safetensors(files.path(ADAM_PATTERN, round_), adam, meta)
    older = numbered_files(files.state_dir, ADAM_PATTERN, files.rank, files.world)
    for r, path in older.items():
        if r != round_:
            path.unlink(missing_ok=True)


def theta_saved(files: RankFiles, round_: int, fp: str) -> bool:
    """Whether this rank's θ file of ``round_`` is there and holds θ of fingerprint ``fp``."""
    path = files.path(THETA_PATTERN, round_)
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("fingerprint") == fp
    except Exception:  # missing or damaged: not saved
        return False


def commit_state(state_dir: Path, state: NodeState, group: Group | None = None) -> None:
    """Commit ``state`` (this rank's e and, on rank 0, the header); θ_round's files must
    already be there. Then delete the files no commit refers to any more (see module doc)."""
    group = group or Group.solo()
    rank, world = group.rank, group.world
    if rank > 0:
        path = state_dir / shard_file(ERROR_PATTERN, state.seq, rank, world)
        error = {"error." + name: t for name, t in state.error.items()}
        write_safetensors(path, error, {"seq": str(state.seq)})
    group.barrier("writing the state")
    if rank == 0:
        header = {
            "version": STATE_VERSION,
            "run_id": state.run_id,
            "node_id": state.node_id,
            "round": state.round,
            "local_steps": state.local_steps,
            "phase": state.phase,
            "fingerprint": state.fingerprint,
            "extra": state.extra,
            "world": world,
            "seq": state.seq,
        }
        error = {"error." + name: t for name, t in state.error.items()}
        write_safetensors(state_dir / STATE_FILE, error, {"sparseloco": json.dumps(header)})
    group.barrier("committing the state")
    for r, path in numbered_files(state_dir, THETA_PATTERN, rank, world).items():
        if r != state.round:
            path.unlink(missing_ok=True)
    if rank > 0:
        for s, path in numbered_files(state_dir, ERROR_PATTERN, rank, world).items():
            if s != state.seq:
                path.unlink(missing_ok=True)
    else:
        clear_pending(state_dir, keep=state.round if state.phase == "submitting" else None)
        _forget_other_worlds(state_dir, world)


def _forget_other_worlds(state_dir: Path, world: int) -> None:
    """(rank 0, after a commit) Delete the files a node of another rank count left behind."""
    for path in state_dir.glob("*.safetensors"):
        if path.name == STATE_FILE:
            continue
        m = _RANKED.search(path.name)
        stale = (m is None and world > 1) or (
            m is not None
            and (int(m.group(1)) >= world or (world == 1 and "error-" not in path.name))
        )
        if path.name.startswith(("theta-", "adam-", "error-")) and stale:
            path.unlink(missing_ok=True)


def save_state(state_dir: Path, state: NodeState, group: Group | None = None) -> None:
    """Write the whole of this rank's ``state`` now: θ (unless its file is there), AdamW, then
    the commit."""
    group = group or Group.solo()
    state_dir.mkdir(parents=True, exist_ok=True)
    files = RankFiles.of(state_dir, group)
    if not theta_saved(files, state.round, state.fingerprint):
        save_theta(files, state.round, state.theta, state.fingerprint)
    if state.adam:
        save_adam(files, state.round, state.adam, state.local_steps)
    commit_state(state_dir, state, group)
