"""The generator seed of a batch, shared by the byte corpus (``node.compute.data``) and the
shard stream (``node.compute.stream``): a module below both, so neither imports the other back.
"""

from __future__ import annotations

import hashlib


def stream_seed(*numbers: int) -> int:
    """A 63-bit generator seed from integers, stable across platforms and Python versions."""
    digest = hashlib.blake2b(":".join(map(str, numbers)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
