"""What the ranks of a node compute together over their shards: its payload and θ's fingerprint.

Each rank owns whole tensors (``node.compute.sharding``), so both are assembled from per-tensor
parts that a rank computes alone, exactly as a single process computes them:

- **the payload**: each rank encodes its tensors' records (``protocol.codec.encode_tensor``, or
  ``node.compute.device.encode_tensor`` for tensors on a GPU: the same bytes), the records go to
  rank 0 over the command channel's gloo group, and rank 0 packs them in name order
  (``protocol.codec.assemble``): byte for byte the payload one process writes for the same
  error buffer. A tensor that cannot be encoded (non-finite values) fails the node's encode on
  every rank alike, before any rank subtracts what it sent from its error buffer;
- **the fingerprint**: each rank hashes its own tensors (``protocol.fingerprint.tensor_digest``),
  every rank gets every digest, and all combine them (``combine``): the fingerprint of the
  whole θ, whatever the split.

And what every rank checks of a peer's payload before reading its records
(``check_payload_header``): the run, the round, the sender and the work the manifest lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgpack
import torch

from node.compute.group import Group
from protocol.codec import Payload, assemble, encode_tensor
from protocol.envelope import TensorRecord, records_from_bytes, records_to_bytes
from protocol.errors import CodecError, PayloadError
from protocol.fingerprint import combine, tensor_digest
from protocol.tiles import TileGeometry, check_codec_params


def encode_tensors(
    group: Group,
    tensors: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    topk: int,
    tile: int,
) -> tuple[list[TensorRecord], dict[str, torch.Tensor]]:
    """This rank's records and reconstructions of ``tensors`` (its own); ``CodecError`` on every
    rank if any rank's tensors cannot be encoded."""
    check_codec_params(topk, tile)
    records: list[TensorRecord] = []
    recon: dict[str, torch.Tensor] = {}
    failure: CodecError | None = None
    try:
        for name in sorted(tensors):
            geometry = TileGeometry.of(shapes[name], topk=topk, tile=tile)
            record, recon[name] = _encode(tensors[name], geometry, name)
            records.append(record)
    except CodecError as exc:
        failure = exc
    if group.any(failure is not None, "agreeing the payload encodes"):
        raise failure or CodecError("another rank of this node could not encode its tensors")
    return records, recon


def _encode(
    x: torch.Tensor, geometry: TileGeometry, name: str
) -> tuple[TensorRecord, torch.Tensor]:
    if x.device.type == "cpu":
        return encode_tensor(x, geometry, name)
    from node.compute import device

    return device.encode_tensor(x, geometry, name)


def node_payload(
    group: Group,
    records: Sequence[TensorRecord],
    *,
    topk: int,
    tile: int,
    run_id: str,
    round_: int,
    node_id: str,
    base: str,
    steps: int = 0,
    tokens: int = 0,
) -> bytes:
    """The node's payload on rank 0, from every rank's ``records``; b"" on the other ranks."""
    parts = group.gather_bytes(records_to_bytes(records), "collecting payload records")
    if parts is None:
        return b""
    every = [r for part in parts for r in records_from_bytes(part)]
    return assemble(
        every, topk=topk, tile=tile, run_id=run_id, round=round_, node_id=node_id, base=base,
        steps=steps, tokens=tokens,
    )  # fmt: skip


def node_fingerprint(group: Group, tensors: Mapping[str, torch.Tensor]) -> str:
    """The fingerprint of the node's θ, from this rank's ``tensors`` and every other rank's."""
    mine = {n: tensor_digest(n, t) for n, t in tensors.items()}
    merged: dict[str, bytes] = {}
    packed = msgpack.packb(mine, use_bin_type=True)
    for part in group.all_gather_bytes(packed, "combining θ's digests"):
        merged.update(msgpack.unpackb(part, raw=False))
    return combine(merged)


def check_payload_header(
    payload: Payload, *, run_id: str, round_: int, node_id: str, steps: int | None = None
) -> None:
    """A gathered payload must say it is for this run, this round and the node it came from,
    and carry the steps the manifest lists for it (when the manifest lists them): the work it
    is weighed by is then the same whoever reads it."""
    checks: list[tuple[str, object, object]] = [
        ("header.run", payload.run_id, run_id),
        ("header.round", payload.round, round_),
        ("header.node", payload.node_id, node_id),
    ]
    if steps is not None:
        checks.append(("header.steps", payload.steps, steps))
    for field, got, want in checks:
        if got != want:
            raise PayloadError(field, f"payload says {got!r}, manifest says {want!r}")
