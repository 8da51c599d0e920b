"""Parameter fingerprints: a short hash that proves two nodes hold bit-identical parameters.

The fingerprint covers every tensor's name, dtype, shape and raw bytes, in sorted name order, so
it changes if any single bit of any parameter changes. Nodes report it every round; the
coordinator compares them and excludes a node whose parameters drifted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

#: Hex digits kept from the sha256; 128 bits is plenty to tell states apart.
FINGERPRINT_HEX = 32


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """Hex fingerprint of a name -> tensor mapping (order of insertion does not matter)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        if t.numel():
            # The tensor's own memory, seen as bytes: hashed in place, never copied.
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()[:FINGERPRINT_HEX]
