"""Reading a node's local state back (``node.compute.state`` writes it): the header, then
each tensor from whichever file holds it.

A state is this rank's share of θ and e (and its AdamW moments) as a commit left them. Every
tensor is read alone (safetensors opens a file and reads one tensor at a time), so no process
holds more than its own share, and a file that is damaged or belongs to another model is a
``StateError`` that names it.

**A different rank count.** The header names the world that wrote it. A node restarted with
another number of ranks *reshards*: each rank reads the tensors it owns now from whichever of
the old files holds them, so θ and e carry over bit for bit. AdamW's moments are FSDP's chunks
of the old layout: they are not carried over; the node starts them fresh with the run's
re-warm-up, as a joiner does, and logs it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from node.compute.state import (
    ADAM_PATTERN,
    ERROR_PATTERN,
    STATE_FILE,
    STATE_VERSION,
    THETA_PATTERN,
    NodeState,
    numbered_files,
    shard_file,
)
from node.errors import StateError

log = logging.getLogger("sparseloco.state")


def read_header(state_dir: Path) -> dict[str, Any] | None:
    """The committed header, or None without a state. ``StateError`` if it is unusable."""
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {})["sparseloco"])
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise StateError(
            f"{path}: unreadable state file ({exc}); move it away to start over"
        ) from exc
    if header.get("version") != STATE_VERSION:
        raise StateError(
            f"{path}: state version {header.get('version')} is not {STATE_VERSION} (written by"
            " an earlier sparseloco); the node recovers from the run's checkpoints instead"
        )
    return dict(header)


class _Tensors:
    """Tensors of several safetensors files, read one at a time by name."""

    def __init__(self, files: list[Path], prefix: str = "") -> None:
        self.prefix = prefix
        self.where: dict[str, Path] = {}
        self.meta: dict[Path, dict[str, str]] = {}
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    self.meta[path] = dict(f.metadata() or {})
                    for key in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                        if key.startswith(prefix):
                            self.where[key[len(prefix) :]] = path
            except Exception as exc:
                raise StateError(f"{path}: unreadable state file ({exc})") from exc

    def load(self, names: Mapping[str, tuple[int, ...]], what: str) -> dict[str, torch.Tensor]:
        out = {}
        for name, shape in names.items():
            path = self.where.get(name)
            if path is None:
                raise StateError(f"the saved {what} does not match this run's model (no {name!r})")
            try:
                with safe_open(str(path), framework="pt") as f:
                    t = f.get_tensor(self.prefix + name)
            except Exception as exc:
                raise StateError(f"{path}: unreadable state file ({exc})") from exc
            if tuple(t.shape) != tuple(shape):
                raise StateError(f"{path}: {what} does not match this run's model ({name})")
            out[name] = t
        return out


def load_state(
    state_dir: Path,
    shapes: Mapping[str, tuple[int, ...]],
    rank: int = 0,
    world: int = 1,
    every: Collection[str] | None = None,
) -> NodeState | None:
    """This rank's share of the saved state (``shapes``: the tensors it owns; ``every``: all
    of the model's, by default ``shapes``'), or None if there is none. ``StateError`` if it is
    unusable. Reshards when another rank count saved it."""
    header = read_header(state_dir)
    if header is None:
        return None
    round_, seq = int(header["round"]), int(header["seq"])
    saved_world = int(header["world"])
    local_steps = int(header["local_steps"])
    thetas = [
        state_dir / shard_file(THETA_PATTERN, round_, k, saved_world) for k in range(saved_world)
    ]
    theta_files = _Tensors(thetas)
    for path, meta in theta_files.meta.items():
        if meta.get("fingerprint") != header["fingerprint"]:
            raise StateError(f"{path}: not the θ the state file was saved with")
    errors = [state_dir / STATE_FILE] + [
        state_dir / shard_file(ERROR_PATTERN, seq, k, saved_world) for k in range(1, saved_world)
    ]
    if set(theta_files.where) != set(shapes if every is None else every):
        raise StateError(f"{state_dir}: the saved θ does not match this run's model")
    theta = theta_files.load(shapes, "θ")
    error = _Tensors(errors, "error.").load(shapes, "e")
    adam: dict[str, torch.Tensor] = {}
    if saved_world == world:
        older = {
            r: p
            for r, p in numbered_files(state_dir, ADAM_PATTERN, rank, world).items()
            if r <= round_
        }
        if older:
            meta, adam = _read_all(older[max(older)])
            if max(older) != round_:  # killed before this round's moments were written
                local_steps = int(meta["local_steps"])
    else:
        local_steps = 0
        if rank == 0:
            log.info(
                "event=state_resharded from_world=%d to_world=%d round=%d (AdamW starts fresh)",
                saved_world, world, round_,
            )  # fmt: skip
    return NodeState(
        run_id=header["run_id"],
        node_id=header["node_id"],
        round=round_,
        theta=theta,
        error=error,
        adam=adam,
        local_steps=local_steps,
        phase=header["phase"],
        fingerprint=header["fingerprint"],
        extra=header.get("extra", {}),
        world=world,
        seq=seq,
    )


def _read_all(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            return meta, {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as exc:
        raise StateError(
            f"{path}: unreadable state file ({exc}); move it away to start over"
        ) from exc
