"""A slow, obvious reference of the SparseLoCo codec, written from DESIGN.md's text alone.

Nothing here imports ``protocol``: tile geometry, per-tile k, Top-k selection, the 2-bit
quantiser and the dense reconstruction are re-derived with plain Python loops and lists, so
the tests can compare the real (vectorised) codec against an independent reading of the spec.
Use it on small tensors only.

- Tiles: a tensor is viewed as a matrix ``(rows, cols)``: 2-D as itself, more dimensions as
  ``(shape[0], prod(rest))``, 1-D as ``(1, n)``, a scalar as ``(1, 1)``. Tiles are ``h x w``
  with ``h`` the largest divisor of ``rows`` that is ``<= tile`` and ``w`` likewise for ``cols``;
  tiles are numbered row-major over the grid and flattened row-major inside (``r * w + c``).
- k per tile: ``max(1, round(tile_len * topk / tile**2))``, halves to even.
- Top-k: the ``k`` largest magnitudes of each tile, ties to the lower position.
- Quantiser (per tensor, over all kept values, in float64): ``shift`` = mean, ``c = v - shift``,
  ``sigma`` = unbiased std of ``c``, ``scale = 6 sigma / 4`` (1 if zero, not finite, or n == 1),
  ``code = clamp(round_half_even(c / scale + 2), 0, 3)``, ``level[j]`` = mean of ``c`` over code
  ``j`` (0 if empty); shift and levels are rounded to fp32 and the dequantised value is
  ``fp32(level) + fp32(shift)`` computed in fp32.

The wire helpers at the end (``split_payload``, ``build_payload``, ``wrap_header``,
``fix_checksums``, ``rice_streams``, ``decode_positions``, ``pack_codes``, ``store_codes``,
``raw_codes``, ``zstd_frame``, ``with_raw_codes``) are a second implementation of format
version 3, written from ``protocol/FORMAT.md`` with the libraries (``struct``, ``zlib``,
``msgpack``, ``zstandard``) directly; tests use them to read payloads independently and to
craft malformed ones.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import zstandard


def fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (as a Python float); overflow gives +-inf."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def largest_divisor(n: int, cap: int) -> int:
    """The largest ``d`` with ``d | n`` and ``d <= cap`` (1 when ``n <= 1``)."""
    best = 1
    for d in range(1, min(n, cap) + 1):
        if n % d == 0:
            best = d
    return best


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    rest = 1
    for d in shape[1:]:
        rest *= d
    return shape[0], rest


def round_half_even_ratio(num: int, den: int) -> int:
    """``num / den`` (non-negative integers) rounded to the nearest integer, halves to even."""
    q, r = divmod(num, den)
    if 2 * r > den or (2 * r == den and q % 2 == 1):
        q += 1
    return q


def k_per_tile(tile_len: int, topk: int, tile: int) -> int:
    return max(1, round_half_even_ratio(tile_len * topk, tile * tile))


@dataclass(frozen=True)
class RefGeometry:
    shape: tuple[int, ...]
    rows: int
    cols: int
    h: int
    w: int
    k: int

    @property
    def tile_len(self) -> int:
        return self.h * self.w

    @property
    def n_tiles(self) -> int:
        if self.rows * self.cols == 0:
            return 0
        return (self.rows // self.h) * (self.cols // self.w)

    def tile_flat_indices(self) -> list[list[int]]:
        """For each tile (row-major over the grid), the row-major flat index of each position."""
        out: list[list[int]] = []
        if self.n_tiles == 0:
            return out
        for ti in range(self.rows // self.h):
            for tj in range(self.cols // self.w):
                idx = []
                for r in range(self.h):
                    for c in range(self.w):
                        idx.append((ti * self.h + r) * self.cols + tj * self.w + c)
                out.append(idx)
        return out


def geometry(shape: tuple[int, ...], *, topk: int, tile: int) -> RefGeometry:
    rows, cols = matrix_view(tuple(shape))
    h = largest_divisor(rows, tile)
    w = largest_divisor(cols, tile)
    return RefGeometry(tuple(shape), rows, cols, h, w, k_per_tile(h * w, topk, tile))


def top_k_positions(values: list[float], k: int) -> list[int]:
    """Ascending positions of the ``k`` largest ``|values|``, ties to the lower position."""
    order = sorted(range(len(values)), key=lambda p: (-abs(values[p]), p))
    return sorted(order[:k])


@dataclass(frozen=True)
class RefQuantized:
    shift: float  # fp32-representable
    levels: tuple[float, float, float, float]  # fp32-representable
    codes: list[int]
    ratios: list[float]  # c / scale + 2 before rounding, to spot values on a .5 boundary
    table: tuple[float, float, float, float]  # fp32(level) + fp32(shift) in fp32


def quantize(values: list[float], codes: list[int] | None = None) -> RefQuantized:
    """The reference quantiser. ``codes``, when given, replaces the computed codes when the
    levels are formed (to compare levels even where a value sits on a rounding boundary)."""
    n = len(values)
    if n == 0:
        return RefQuantized(0.0, (0.0, 0.0, 0.0, 0.0), [], [], (0.0, 0.0, 0.0, 0.0))
    shift = math.fsum(values) / n
    c = [v - shift for v in values]
    if n > 1:
        mean_c = math.fsum(c) / n
        sigma = math.sqrt(math.fsum((x - mean_c) ** 2 for x in c) / (n - 1))
    else:
        sigma = math.nan
    scale = 6.0 * sigma / 4.0
    if not math.isfinite(scale) or scale == 0.0:
        scale = 1.0
    ratios = [x / scale + 2.0 for x in c]
    if codes is None:
        codes = [min(3, max(0, round(t))) for t in ratios]  # Python's round: half to even
    levels = []
    for j in range(4):
        members = [x for x, code in zip(c, codes, strict=True) if code == j]
        levels.append(fp32(math.fsum(members) / len(members)) if members else 0.0)
    s32 = np.float32(fp32(shift))
    with np.errstate(over="ignore"):
        table = tuple(float(np.float32(lv) + s32) for lv in levels)
    return RefQuantized(
        fp32(shift),
        (levels[0], levels[1], levels[2], levels[3]),
        codes,
        ratios,
        (table[0], table[1], table[2], table[3]),
    )


@dataclass(frozen=True)
class RefEncoded:
    """The reference's view of one encoded tensor."""

    geometry: RefGeometry
    positions: list[list[int]]  # per tile, ascending
    values: list[float]  # kept values, tile-major, ascending position inside a tile
    quantized: RefQuantized
    recon: torch.Tensor  # dense fp32, the input's shape


def encode_tensor(x: torch.Tensor, *, topk: int, tile: int) -> RefEncoded:
    """Reference compression of one tensor (plain loops; small tensors only)."""
    g = geometry(tuple(x.shape), topk=topk, tile=tile)
    flat = [float(v) for v in x.detach().to(torch.float32).reshape(-1).tolist()]
    positions: list[list[int]] = []
    values: list[float] = []
    flat_kept: list[int] = []
    for idx in g.tile_flat_indices():
        tile_vals = [flat[i] for i in idx]
        pos = top_k_positions(tile_vals, g.k)
        positions.append(pos)
        values.extend(tile_vals[p] for p in pos)
        flat_kept.extend(idx[p] for p in pos)
    q = quantize(values)
    dense = [0.0] * len(flat)
    for i, code in zip(flat_kept, q.codes, strict=True):
        dense[i] = q.table[code]
    recon = torch.tensor(dense, dtype=torch.float32).reshape(x.shape)
    return RefEncoded(g, positions, values, q, recon)


def stats_bytes(shift: float, levels: tuple[float, ...]) -> bytes:
    """The 20-byte statistics block: shift then the four levels, little-endian fp32."""
    return struct.pack("<5f", shift, *levels)


def read_bits(data: bytes) -> list[int]:
    """Every bit of ``data``, most significant first within each byte."""
    return [(byte >> (7 - i)) & 1 for byte in data for i in range(8)]


def decode_positions(
    rice_bits: int, unary: bytes, remainders: bytes, *, n_tiles: int, k: int
) -> list[list[int]]:
    """Reference Rice decoder (no validation): quotients in unary (zeros then a one), remainders
    as fixed ``rice_bits``-bit fields, gaps ``g_0 = p_0`` and ``g_j = p_j - p_{j-1} - 1``."""
    ubits, rbits = read_bits(unary), read_bits(remainders)
    quotients, q = [], 0
    for bit in ubits:
        if bit:
            quotients.append(q)
            q = 0
        else:
            q += 1
    out, at = [], 0
    for t in range(n_tiles):
        pos, prev = [], -1
        for j in range(k):
            r = 0
            for _ in range(rice_bits):
                r = (r << 1) | rbits[at]
                at += 1
            gap = (quotients[t * k + j] << rice_bits) | r
            prev = prev + gap + 1
            pos.append(prev)
        out.append(pos)
    return out


# --------------------------------------------------------------------------- wire helpers

MAGIC = b"SLCP"
VERSION = 3
PREFIX = struct.Struct("<4sBBII")  # magic, version, flags, header length L, CRC-32 of the header
HEADER_KEYS = ("run", "round", "node", "base", "tile", "topk", "steps", "tokens", "tensors")
ENTRY_FIELDS = (
    "name",
    "shape",
    "rice_bits",
    "stats",
    "codes_len",
    "unary_len",
    "remainders_len",
    "crc32",
    "codes_zstd",
)
ZSTD = ENTRY_FIELDS.index("codes_zstd")
SECTIONS = ("codes", "unary", "remainders")
Record = tuple[bytes, bytes, bytes]  # codes, unary stream, remainder stream


def pack_bits(bits: list[int]) -> bytes:
    """Bits, most significant first within each byte, the last byte padded with zeros."""
    out = bytearray()
    for i in range(0, len(bits), 8):
        chunk = bits[i : i + 8] + [0] * (8 - len(bits[i : i + 8]))
        out.append(sum(bit << (7 - j) for j, bit in enumerate(chunk)))
    return bytes(out)


def pack_codes(codes: list[int]) -> bytes:
    """2-bit codes four to a byte, the first code in the two most significant bits."""
    bits = []
    for code in codes:
        bits += [(code >> 1) & 1, code & 1]
    return pack_bits(bits)


def zstd_frame(
    data: bytes, *, level: int = 1, content_size: bool = True, checksum: bool = False
) -> bytes:
    """One zstd frame of ``data`` (by default as FORMAT.md's writers make it: level 1, the
    content size declared, no checksum, no dictionary id)."""
    return zstandard.ZstdCompressor(
        level=level,
        write_content_size=content_size,
        write_checksum=checksum,
        write_dict_id=False,
    ).compress(data)


def store_codes(raw: bytes) -> tuple[bytes, int]:
    """``(stored, codes_zstd)``: a writer's choice, the frame when strictly shorter."""
    frame = zstd_frame(raw)
    return (frame, 1) if len(frame) < len(raw) else (raw, 0)


def raw_codes(stored: bytes, codes_zstd: int, size: int) -> bytes:
    """The raw codes of a record, asserting FORMAT.md's rules for a zstd frame: the magic,
    a declared content size of exactly ``size``, no dictionary, a window within the content,
    nothing after the frame."""
    if not codes_zstd:
        assert len(stored) == size
        return stored
    assert len(stored) < size and stored[:4] == b"\x28\xb5\x2f\xfd"
    params = zstandard.get_frame_parameters(stored)
    assert params.content_size == size and params.dict_id == 0 and params.window_size <= size
    raw = zstandard.ZstdDecompressor().decompress(stored, allow_extra_data=False)
    assert len(raw) == size
    return raw


def rice_streams(gaps: list[int], rice_bits: int) -> tuple[bytes, bytes]:
    """``(unary, remainders)`` for a flat list of gaps (no validation: any gaps may be coded)."""
    unary, rem = [], []
    for g in gaps:
        unary += [0] * (g >> rice_bits) + [1]
        rem += [(g >> (rice_bits - 1 - i)) & 1 for i in range(rice_bits)]
    return pack_bits(unary), pack_bits(rem)


def gaps_of(positions: list[list[int]]) -> list[int]:
    out = []
    for tile in positions:
        prev = -1
        for p in tile:
            out.append(p - prev - 1)
            prev = p
    return out


@dataclass(frozen=True)
class SplitPayload:
    """A well-formed payload taken apart: prefix fields, header map, each record's sections."""

    version: int
    flags: int
    header_length: int
    header: dict[str, Any]
    records: list[Record]
    offsets: list[int]  # absolute offset of each record


def record_crc(record: Record) -> int:
    """CRC-32 of the record as stored: codes ‖ unary ‖ remainders."""
    return zlib.crc32(b"".join(record))


def split_payload(data: bytes) -> SplitPayload:
    """Read a well-formed payload with the libraries directly, asserting every layout rule of
    FORMAT.md (prefix, header CRC, key set, entry lengths and CRCs, exact total size)."""
    magic, version, flags, length, crc = PREFIX.unpack_from(data)
    assert magic == MAGIC and version == VERSION and flags == 0
    header_bytes = data[PREFIX.size : PREFIX.size + length]
    assert len(header_bytes) == length and zlib.crc32(header_bytes) == crc
    header = msgpack.unpackb(header_bytes, raw=False)
    assert isinstance(header, dict) and set(header) == set(HEADER_KEYS)
    at = PREFIX.size + length
    records, offsets = [], []
    for entry in header["tensors"]:
        assert len(entry) == len(ENTRY_FIELDS) and entry[ZSTD] in (0, 1)
        assert not isinstance(entry[ZSTD], bool)
        offsets.append(at)
        sections = []
        for size in entry[4:7]:
            sections.append(data[at : at + size])
            at += size
        record = (sections[0], sections[1], sections[2])
        assert record_crc(record) == entry[7]
        records.append(record)
    assert at == len(data), "nothing may follow the last record"
    return SplitPayload(version, flags, length, header, records, offsets)


def wrap_header(
    header: bytes,
    data: bytes = b"",
    *,
    version: int = VERSION,
    flags: int = 0,
    length: int | None = None,
    crc: int | None = None,
) -> bytes:
    """The prefix (correct unless ``length``/``crc`` are given) + ``header`` as stored +
    ``data``."""
    length = len(header) if length is None else length
    crc = zlib.crc32(header) if crc is None else crc
    return PREFIX.pack(MAGIC, version, flags, length, crc) + header + data


def build_payload(
    header: Any,
    records: list[Record] | tuple[Record, ...] = (),
    *,
    sync: bool = True,
    version: int = VERSION,
    flags: int = 0,
) -> bytes:
    """``header`` packed with msgpack behind a correct prefix, then ``records``' sections in
    order. With ``sync``, each well-formed entry's three lengths and CRC are first set from
    the record at its place (so any sections can be written and the deep checks still run);
    its ``codes_zstd`` stays as the entry has it."""
    if sync and isinstance(header, dict) and isinstance(header.get("tensors"), list):
        header = {**header, "tensors": list(header["tensors"])}
        for i, (entry, record) in enumerate(zip(header["tensors"], records, strict=False)):
            if isinstance(entry, list) and len(entry) == len(ENTRY_FIELDS):
                lengths = [len(part) for part in record]
                header["tensors"][i] = [*entry[:4], *lengths, record_crc(record), *entry[8:]]
    raw = msgpack.packb(header, use_bin_type=True)
    data = b"".join(part for record in records for part in record)
    return wrap_header(raw, data, version=version, flags=flags)


def with_raw_codes(data: bytes, *, topk: int, tile: int) -> bytes:
    """The well-formed payload ``data`` with every record's codes stored raw (what a writer
    that never compresses would send): the same tensors, the records' other bytes as they are."""
    split = split_payload(data)
    header = {**split.header, "tensors": [list(e) for e in split.header["tensors"]]}
    records = []
    for entry, (stored, unary, rem) in zip(header["tensors"], split.records, strict=True):
        g = geometry(tuple(entry[1]), topk=topk, tile=tile)
        records.append((raw_codes(stored, entry[ZSTD], (g.n_tiles * g.k + 3) // 4), unary, rem))
        entry[ZSTD] = 0
    return build_payload(header, records)


def fix_checksums(data: bytes) -> bytes:
    """``data`` with its checksums made to match whatever it holds: each record's CRC as its
    entry's lengths cut it (when the header still parses as a map with such entries), then the
    header's CRC; lengths and every other byte as they are."""
    if len(data) < PREFIX.size:
        return data
    _, version, flags, length, _ = PREFIX.unpack_from(data)
    header_bytes = data[PREFIX.size : PREFIX.size + length]
    rest = data[PREFIX.size + length :]
    try:
        header = msgpack.unpackb(header_bytes, raw=False)
        entries = header["tensors"]
        at = PREFIX.size + length
        changed = False
        for entry in entries:
            sizes = entry[4:7]
            if not all(isinstance(n, int) and n >= 0 for n in sizes):
                raise ValueError("not a well-formed entry")
            crc = zlib.crc32(data[at : at + sum(sizes)])
            at += sum(sizes)
            changed |= entry[7] != crc
            entry[7] = crc
        if changed:
            header_bytes = msgpack.packb(header, use_bin_type=True)
    except Exception:  # an unreadable header keeps its bytes: only its own CRC is fixed
        pass
    return wrap_header(header_bytes, rest, version=version, flags=flags)
