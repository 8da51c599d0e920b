"""Checkpoint files for the coordinator's tests: real safetensors files of one fixed θ.

The coordinator verifies a checkpoint's bytes before it commits it (``coordinator.store.verify``),
so a test that commits one must upload a real safetensors file whose tensors have the fingerprint
the nodes reported. ``theta_file(tag)`` gives such a file: the tensors are always ``THETA`` (so
its fingerprint is always ``THETA_FP``), the tag goes into the file's metadata, so files with
different tags differ in their bytes (size, sha256) and not in what they hold.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from safetensors.torch import save

from protocol.fingerprint import fingerprint

#: The parameters every test checkpoint holds.
THETA = {
    "embed.weight": torch.arange(24, dtype=torch.float32).reshape(6, 4) / 7,
    "head.bias": torch.linspace(-1, 1, 5),
}
#: Their fingerprint: what the nodes of a checkpoint test report.
THETA_FP = fingerprint(THETA)


def theta_file(tag: str = "", tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    """A safetensors file of ``tensors`` (``THETA`` by default) with ``tag`` in its metadata."""
    return save(tensors if tensors is not None else THETA, metadata={"tag": tag})


def offer(body: bytes, fingerprint: str = THETA_FP) -> dict[str, Any]:
    """The JSON body offering ``body`` as a checkpoint of ``fingerprint``."""
    return {
        "size": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
        "fingerprint": fingerprint,
    }
