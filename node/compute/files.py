"""Safetensors files written atomically, behind the round, or by several processes at once.

- ``write_safetensors``: a whole file from tensors' own memory (no serialised copy), to a
  temporary name, fsynced, renamed, the directory fsynced: a crash leaves it whole or absent.
- ``Writer``/``Writes``: one such write at a time on a background thread, waited for where the
  next change of the tensors would race it (``node.compute.state`` says which).
- ``SafetensorsLayout``: where each tensor's bytes go in a file whose header is known from the
  shapes alone, so the ranks of a node write their own tensors into one shared file with
  ``os.pwrite`` (a checkpoint: ``node.compute.checkpoint``), none of them holding the others'.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from node.errors import StateError

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


def fsync_write(path: Path, data: bytes) -> None:
    """``data`` to ``path`` atomically (temporary name, fsync, rename, fsync of the folder)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as bytes, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy().data)


@dataclass(frozen=True)
class SafetensorsLayout:
    """The header and each tensor's byte range of a file holding ``shapes`` (dtype ``dtype``,
    tensors in sorted name order, the data section 8-byte aligned)."""

    header: bytes
    #: name -> (begin, end), absolute offsets in the file.
    ranges: dict[str, tuple[int, int]]
    size: int

    @classmethod
    def of(
        cls,
        shapes: Mapping[str, tuple[int, ...]],
        meta: Mapping[str, str],
        dtype: torch.dtype = torch.float32,
    ) -> SafetensorsLayout:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        entries: dict[str, Any] = {}
        spans: dict[str, tuple[int, int]] = {}
        offset = 0
        for name in sorted(shapes):
            size = math.prod(shapes[name]) * itemsize
            entries[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shapes[name]),
                "data_offsets": [offset, offset + size],
            }
            spans[name] = (offset, offset + size)
            offset += size
        head = json.dumps({"__metadata__": dict(meta), **entries}, separators=(",", ":"))
        raw = head.encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        header = len(raw).to_bytes(8, "little") + raw
        base = len(header)
        ranges = {n: (base + b, base + e) for n, (b, e) in spans.items()}
        return cls(header, ranges, base + offset)

    def write_tensors(self, path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write ``tensors`` (some of the layout's) at their offsets of the existing file."""
        fd = os.open(path, os.O_WRONLY)
        try:
            for name, t in tensors.items():
                begin, end = self.ranges[name]
                data = _bytes_of(t.detach().to("cpu", torch.float32).contiguous())
                if len(data) != end - begin:
                    raise ValueError(f"{name}: {len(data)} bytes for a slot of {end - begin}")
                written = 0
                while written < len(data):
                    written += os.pwrite(fd, data[written:], begin + written)
            os.fsync(fd)
        finally:
            os.close(fd)

    def create(self, path: Path) -> None:
        """The file at its full size with the header written (the tensors follow)."""
        with open(path, "wb") as f:
            f.write(self.header)
            f.truncate(self.size)
            f.flush()
            os.fsync(f.fileno())


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
                f.write(_bytes_of(t))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
