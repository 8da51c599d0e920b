"""The node's local state on disk: what a restart needs to continue exactly where it stopped.

One safetensors file holds θ, the error-feedback buffer e and the AdamW moments; its metadata
holds the JSON header (run id, node id, next round, phase, fingerprint, AdamW step counts).
It is written to a temporary file, fsynced and renamed over the old one, so a crash at any
instant leaves either the previous state or the new one, never a torn mix. safetensors reads
only tensors, never code.

Phases:

- ``idle``: θ is θ_round; nothing of round ``round`` has been computed yet.
- ``submitting``: round ``round`` was trained and compressed; e already has ĉ subtracted and
  ``pending.slc`` (written first, also atomically) holds the payload, so a restart re-sends the
  very same bytes (the write-once key makes the repeat harmless) instead of training again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from node.errors import StateError

STATE_FILE = "state.safetensors"
PENDING_FILE = "pending.slc"
STATE_VERSION = 1

Phase = Literal["idle", "submitting"]


@dataclass
class NodeState:
    """Everything a node keeps between rounds."""

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


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_pending(state_dir: Path, payload: bytes) -> None:
    """Atomically store the payload of the round being submitted."""
    state_dir.mkdir(parents=True, exist_ok=True)
    _fsync_write(state_dir / PENDING_FILE, payload)


def load_pending(state_dir: Path) -> bytes | None:
    path = state_dir / PENDING_FILE
    return path.read_bytes() if path.exists() else None


def save_state(state_dir: Path, state: NodeState) -> None:
    """Atomically replace the state file with ``state``."""
    state_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for prefix, group in (("theta.", state.theta), ("error.", state.error), ("adam.", state.adam)):
        for name, t in group.items():
            tensors[prefix + name] = t.detach().cpu().contiguous()
    header = {
        "version": STATE_VERSION,
        "run_id": state.run_id,
        "node_id": state.node_id,
        "round": state.round,
        "local_steps": state.local_steps,
        "phase": state.phase,
        "fingerprint": state.fingerprint,
        "extra": state.extra,
    }
    path = state_dir / STATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"sparseloco": json.dumps(header)})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(state_dir)


def load_state(state_dir: Path, shapes: Mapping[str, tuple[int, ...]]) -> NodeState | None:
    """The saved state, or None if there is none. ``StateError`` if it is unusable."""
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        header = json.loads(meta["sparseloco"])
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise StateError(
            f"{path}: unreadable state file ({exc}); move it away to start over"
        ) from exc
    if header.get("version") != STATE_VERSION:
        raise StateError(f"{path}: state version {header.get('version')} is not {STATE_VERSION}")
    groups: dict[str, dict[str, torch.Tensor]] = {"theta.": {}, "error.": {}, "adam.": {}}
    for key, t in tensors.items():
        prefix = key[: key.index(".") + 1]
        groups[prefix][key[len(prefix) :]] = t
    for kind in ("theta.", "error."):
        got = {n: tuple(t.shape) for n, t in groups[kind].items()}
        if got != dict(shapes):
            raise StateError(f"{path}: {kind[:-1]} does not match this run's model")
    return NodeState(
        run_id=header["run_id"],
        node_id=header["node_id"],
        round=int(header["round"]),
        theta=groups["theta."],
        error=groups["error."],
        adam=groups["adam."],
        local_steps=int(header["local_steps"]),
        phase=header["phase"],
        fingerprint=header["fingerprint"],
        extra=header.get("extra", {}),
    )


def adam_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The AdamW moments and step counts as a flat name -> tensor mapping."""
    out: dict[str, torch.Tensor] = {}
    for i, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            out[f"{i}.{key}"] = t
    return out


def restore_adam(opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load moments saved by ``adam_tensors`` into ``opt`` (same parameter layout)."""
    state_dict = opt.state_dict()
    restored: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        index, name = key.split(".", 1)
        restored.setdefault(int(index), {})[name] = t
    state_dict["state"] = restored
    opt.load_state_dict(state_dict)
