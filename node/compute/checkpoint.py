"""Checkpoints as files: θ written into one safetensors file by every rank, and read back.

A checkpoint is one safetensors object per round that any node can read, whatever its rank
count. Its layout is a function of the model alone (``SafetensorsLayout``: the header, then
every tensor in sorted name order), so the ranks of a node write it together: rank 0 creates
the file at its full size with the header, and each rank writes its own tensors at their
offsets (``os.pwrite``). No process holds the whole model; rank 0 then hashes the file (sha256,
read a chunk at a time) for the offer, and the daemon uploads it from disk.

Reading is the mirror image: rank 0 downloads the object to a file (``Transfers.get_to_file``,
size and sha256 checked), every rank checks the header against the run's model (names, shapes,
F32) and reads its own tensors, and the digests of all of them (``protocol.fingerprint``) must
combine to the fingerprint the nodes agreed on. safetensors holds only tensors (no code), so a
hostile file can at worst be wrong, which these checks catch on every rank alike.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from node.compute.files import SafetensorsLayout
from node.compute.shards import node_fingerprint
from node.errors import CheckpointError

if TYPE_CHECKING:
    from node.compute.worker import Worker

#: Bytes read at a time to hash a file.
CHUNK = 8 << 20


def sha256_file(path: Path, chunk: int = CHUNK) -> str:
    """sha256 (hex) of a file, read ``chunk`` bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def layout(worker: Worker) -> SafetensorsLayout:
    return SafetensorsLayout.of(worker.shapes, {"run_id": worker.run_id})


def write_checkpoint_file(worker: Worker, path: Path) -> tuple[int, str, str]:
    """(every rank) θ_{worker.round} into ``path``; its size, sha256 (rank 0, else "") and
    θ's fingerprint."""
    group = worker.group
    plan = layout(worker)
    worker.writes.theta.wait()
    if group.leader:
        path.parent.mkdir(parents=True, exist_ok=True)
        plan.create(path)
    group.barrier("creating the checkpoint file")
    plan.write_tensors(path, worker.params)
    group.barrier("writing the checkpoint")
    fp = worker.fingerprint()
    return plan.size, sha256_file(path) if group.leader else "", fp


def load_checkpoint_file(worker: Worker, path: Path, *, round_: int, expected: str) -> None:
    """(every rank) θ from the checkpoint file of round ``round_`` after checking names,
    shapes, dtype and the fingerprint ``expected``. The error buffer and AdamW stay as they
    are. ``CheckpointError`` on every rank if any rank finds anything wrong."""
    group = worker.group
    failure: CheckpointError | None = None
    tensors: dict[str, torch.Tensor] = {}
    try:
        tensors = _read(path, worker, round_)
    except CheckpointError as exc:
        failure = exc
    if group.any(failure is not None, "checking the checkpoint"):
        raise failure or CheckpointError(
            f"checkpoint of round {round_} failed a check on another rank of this node"
        )
    actual = node_fingerprint(group, tensors)
    if actual != expected:
        raise CheckpointError(
            f"checkpoint of round {round_} has fingerprint {actual}, expected {expected}"
        )
    worker.start_at(tensors, round_, actual)


def _read(path: Path, worker: Worker, round_: int) -> dict[str, torch.Tensor]:
    """This rank's tensors of the file, after the whole header checked out."""
    try:
        with safe_open(str(path), framework="pt") as f:
            got = {}
            for name in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                view = f.get_slice(name)
                got[name] = (tuple(view.get_shape()), view.get_dtype())
            if got != {n: (tuple(s), "F32") for n, s in worker.shapes.items()}:
                raise CheckpointError(f"checkpoint of round {round_} does not match the model")
            return {n: f.get_tensor(n) for n in worker.owned}
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises several types for bad bytes
        raise CheckpointError(f"checkpoint of round {round_} is unreadable: {exc}") from exc
