"""The node's local state on disk: what a restart needs to continue exactly where it stopped.

Three kinds of safetensors file, each written to a temporary file straight from the tensors'
memory (no serialised copy), fsynced, renamed over the old one, the directory fsynced, so a
crash at any instant leaves a file either whole or not there:

- ``state.safetensors``: the commit point. The error-feedback buffer e, and in its metadata the
  JSON header (run id, node id, round, phase, θ's fingerprint, inner steps, mass);
- ``theta-{round}.safetensors``: θ_round, with its fingerprint (checked again when loaded);
- ``adam-{round}.safetensors``: the AdamW moments after training round ``round``.

Phases:

- ``idle``: θ is θ_round; nothing of round ``round`` has been computed yet.
- ``submitting``: round ``round`` was trained from θ_round and compressed; e already has ĉ
  subtracted and ``pending-{round}.slc`` (written first, also atomically) holds the payload, so
  a restart re-sends the very same bytes (the write-once key makes the repeat harmless) instead
  of training again.

What is on a round's critical path (measured by ``node.research.bench.node_work``): before this
layout the node wrote θ, e and AdamW (16 B/param, fsynced) after training and again after
applying the aggregate. Now, for a round it trains:

1. after applying round r-1, θ_r is written behind, on a background thread (``Writer``), while
   the node evaluates and trains round r: training works on a copy of θ, so θ_r's memory stays
   still until round r is applied, and nothing else may change θ before waiting for the write
   (the worker waits in every method that changes θ);
2. after training round r: the payload, then ``state.safetensors`` (e and the header: 4 B/param)
   on the path, after waiting for θ_r's file (long done by then);
3. AdamW's moments are written behind, while the payload goes up and the round closes; the next
   training waits for that write. A kill before it completes leaves the previous round's
   moments: local, never shared, a restart then trains on with moments one round old (which
   changes no peer's θ), the same stance as an abandoned training (see ``Worker``).

Applying the aggregate writes nothing: θ_{r+1} and the settled e follow from the state saved
after training and round r's signed manifest and payloads, which is exactly what a restart does
(it finishes round r again, as a late joiner replays it). ``idle`` is written whole, waiting for
every file, when the node did not train (catch-up, a resync, a checkpoint, the end of the run).
Finishing a round again needs its payloads still in the store; once retention deleted them the
node skips to a checkpoint, as any node that far behind does. A state from before this layout
(one file, version 1) is still read.

Measured at 81 M parameters on this project's 2 shared (and busy) cores, ns/param on the round's
path: the save after training 31.6 -> 10.8, the step after applying 47.2 -> 1.1 (a fingerprint
and a thread start). The writes behind still cost CPU, off the path. Fsyncing once instead of
writing less would not do: the bytes themselves (16 B/param twice) were the cost.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from node.errors import StateError

STATE_FILE = "state.safetensors"
#: The payload of a round being submitted: ``pending-{round}.slc``.
PENDING_PATTERN = "pending-{}.slc"
#: Where state written before payload files were named by round kept its payload.
LEGACY_PENDING_FILE = "pending.slc"
THETA_PATTERN = "theta-{}.safetensors"
ADAM_PATTERN = "adam-{}.safetensors"
STATE_VERSION = 2
#: The single-file layout (θ, e and AdamW in ``state.safetensors``), read for old state dirs.
LEGACY_VERSION = 1
#: torch dtype -> safetensors dtype, for what a state holds (fp32 tensors, AdamW step counts).
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

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


class Writer:
    """One write at a time on a background thread: ``start`` waits for the previous one.

    The thread is not a daemon thread, so a process that exits normally finishes the write
    first; a killed one leaves the previous file (the write is atomic). A failed write is
    raised, as ``StateError``, by the next ``wait`` or ``start``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, write: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # handed to the caller's next wait
                self._error = exc

        self._thread = threading.Thread(target=run, name=f"write-{self.name}")
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise StateError(f"writing {self.name} to the state dir failed: {error}") from error


@dataclass
class Writes:
    """A node's two write-behind streams: θ (after applying) and AdamW (after training)."""

    theta: Writer = field(default_factory=lambda: Writer("theta"))
    adam: Writer = field(default_factory=lambda: Writer("adam"))

    def wait(self) -> None:
        self.theta.wait()
        self.adam.wait()


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


def pending_path(state_dir: Path, round_: int) -> Path:
    return state_dir / PENDING_PATTERN.format(round_)


def save_pending(state_dir: Path, round_: int, payload: bytes) -> None:
    """Atomically store the payload of round ``round_``, which is being submitted.

    Named by round: the state file on disk may still describe the previous round's payload
    until the new state replaces it, so the two must not share a file.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    _fsync_write(pending_path(state_dir, round_), payload)


def load_pending(state_dir: Path, round_: int) -> bytes | None:
    """The stored payload of round ``round_``, or None."""
    for path in (pending_path(state_dir, round_), state_dir / LEGACY_PENDING_FILE):
        if path.exists():
            return path.read_bytes()
    return None


def clear_pending(state_dir: Path, keep: int | None = None) -> None:
    """Delete stored payloads but round ``keep``'s (after a state that no longer needs them)."""
    for path in state_dir.glob(PENDING_PATTERN.format("*")):
        if keep is None or path.name != PENDING_PATTERN.format(keep):
            path.unlink(missing_ok=True)
    (state_dir / LEGACY_PENDING_FILE).unlink(missing_ok=True)


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], meta: dict[str, str]
) -> None:
    """Atomically write ``tensors`` as a safetensors file, straight from their memory.

    The header first, then every tensor's bytes in name order, each handed to the kernel as a
    view of the tensor (no serialised copy of the whole state in between); one fsync of the
    file, the rename, one fsync of the directory.
    """
    flat: list[torch.Tensor] = []
    entries: dict[str, Any] = {}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        size = t.numel() * t.element_size()
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        flat.append(t)
    header = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data section starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for t in flat:
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _numbered(state_dir: Path, pattern: str) -> dict[int, Path]:
    """The files of ``pattern`` in ``state_dir`` by their round."""
    prefix, suffix = pattern.split("{}")
    out = {}
    for path in state_dir.glob(pattern.format("*")):
        number = path.name[len(prefix) : len(path.name) - len(suffix)]
        if number.isdigit():
            out[int(number)] = path
    return out


def save_theta(state_dir: Path, round_: int, theta: Mapping[str, torch.Tensor], fp: str) -> None:
    """θ_round to ``theta-{round}.safetensors`` with its fingerprint."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / THETA_PATTERN.format(round_)
    write_safetensors(path, theta, {"round": str(round_), "fingerprint": fp})


def save_adam(
    state_dir: Path, round_: int, adam: Mapping[str, torch.Tensor], local_steps: int
) -> None:
    """The AdamW moments to ``adam-{round}.safetensors``; older ones are deleted after it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    meta = {"round": str(round_), "local_steps": str(local_steps)}
    write_safetensors(state_dir / ADAM_PATTERN.format(round_), adam, meta)
    for r, path in _numbered(state_dir, ADAM_PATTERN).items():
        if r != round_:
            path.unlink(missing_ok=True)


def theta_saved(state_dir: Path, round_: int, fp: str) -> bool:
    """Whether ``theta-{round}.safetensors`` is there and holds θ of fingerprint ``fp``."""
    path = state_dir / THETA_PATTERN.format(round_)
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("fingerprint") == fp
    except Exception:  # missing or damaged: not saved
        return False


def commit_state(state_dir: Path, state: NodeState) -> None:
    """Write ``state.safetensors`` (e and the header); θ_round's file must already be there.
    Then delete the θ files and payloads no state refers to any more."""
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
    error = {"error." + name: t for name, t in state.error.items()}
    write_safetensors(state_dir / STATE_FILE, error, {"sparseloco": json.dumps(header)})
    for r, path in _numbered(state_dir, THETA_PATTERN).items():
        if r != state.round:
            path.unlink(missing_ok=True)
    clear_pending(state_dir, keep=state.round if state.phase == "submitting" else None)


def save_state(state_dir: Path, state: NodeState) -> None:
    """Write the whole ``state`` now: θ (unless its file is there), AdamW, then the commit."""
    state_dir.mkdir(parents=True, exist_ok=True)
    if not theta_saved(state_dir, state.round, state.fingerprint):
        save_theta(state_dir, state.round, state.theta, state.fingerprint)
    if state.adam:
        save_adam(state_dir, state.round, state.adam, state.local_steps)
    commit_state(state_dir, state)


def load_state(state_dir: Path, shapes: Mapping[str, tuple[int, ...]]) -> NodeState | None:
    """The saved state, or None if there is none. ``StateError`` if it is unusable."""
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    header, tensors = _read(path)
    if header.get("version") not in (STATE_VERSION, LEGACY_VERSION):
        raise StateError(f"{path}: state version {header.get('version')} is not {STATE_VERSION}")
    groups: dict[str, dict[str, torch.Tensor]] = {"theta.": {}, "error.": {}, "adam.": {}}
    for key, t in tensors.items():
        prefix = key[: key.index(".") + 1]
        groups[prefix][key[len(prefix) :]] = t
    round_ = int(header["round"])
    local_steps = int(header["local_steps"])
    if header["version"] == STATE_VERSION:
        theta_path = state_dir / THETA_PATTERN.format(round_)
        theta_meta, groups["theta."] = _read(theta_path, key=None)
        if theta_meta.get("fingerprint") != header["fingerprint"]:
            raise StateError(f"{theta_path}: not the θ the state file was saved with")
        older = {r: p for r, p in _numbered(state_dir, ADAM_PATTERN).items() if r <= round_}
        if older:
            adam_meta, groups["adam."] = _read(older[max(older)], key=None)
            if max(older) != round_:  # killed before this round's moments were written
                local_steps = int(adam_meta["local_steps"])
    for kind in ("theta.", "error."):
        got = {n: tuple(t.shape) for n, t in groups[kind].items()}
        if got != dict(shapes):
            raise StateError(f"{path}: {kind[:-1]} does not match this run's model")
    return NodeState(
        run_id=header["run_id"],
        node_id=header["node_id"],
        round=round_,
        theta=groups["theta."],
        error=groups["error."],
        adam=groups["adam."],
        local_steps=local_steps,
        phase=header["phase"],
        fingerprint=header["fingerprint"],
        extra=header.get("extra", {}),
    )


def _read(path: Path, key: str | None = "sparseloco") -> tuple[dict[str, Any], dict[str, Any]]:
    """A file's metadata (``key``'s JSON, or the metadata itself) and its tensors."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
        return (json.loads(meta[key]) if key else dict(meta)), tensors
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise StateError(
            f"{path}: unreadable state file ({exc}); move it away to start over"
        ) from exc


def adam_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The AdamW moments and step counts as a flat name -> tensor mapping, on the CPU.

    An optimiser on a GPU has its state copied over (so a state file is the same whatever the
    device, and a write behind never reads memory the next round's steps change); on the CPU
    the tensors are the optimiser's own, as before (the next training waits for their write).
    """
    out: dict[str, torch.Tensor] = {}
    for i, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            out[f"{i}.{key}"] = t.detach().cpu()
    return out


def restore_adam(opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load moments saved by ``adam_tensors`` into ``opt`` (same parameter layout); torch puts
    each on its parameter's device (CPU files into a GPU optimiser, and back)."""
    state_dict = opt.state_dict()
    restored: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        index, name = key.split(".", 1)
        restored.setdefault(int(index), {})[name] = t
    state_dict["state"] = restored
    opt.load_state_dict(state_dict)
