"""Fuzz the payload decoder by hand: millions of hostile inputs, every outcome checked.

    python tests/bench/fuzz_decoder.py --inputs 1000000 [--workers 2] [--seed 0]

Each input starts from one of four valid payloads (small, constant, larger, and one with a
record of each form of codes; the last three hold zstd frames of codes) and is broken one of
several ways: random byte edits behind recomputed checksums (so the deep checks run, on the
frames' bytes too), bit flips and truncations as they arrive (the CRCs must catch them), random
bytes, a valid prefix over random header bytes, or a record's codes replaced by a well-formed
zstd frame of edited codes (bytes changed, one byte more or fewer, another level, a checksum or
no content size, the flag sometimes wrong), behind recomputed lengths and checksums. Every
input is decoded every way (eager, lazy as the node reads peers, dense, partially); each must
either raise ``PayloadError`` naming a field, or give a payload that is consistent (positions
inside their tiles and increasing, codes in range, finite values), and the readers must reach
agreeing verdicts. Anything else (another exception, a
hang, a crash) is a failure, printed with the input in hex so it can become a test. The CI run
of the same properties is hypothesis, in ``tests/test_codec_malformed*.py``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import time
from pathlib import Path

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for ``support``

from protocol.codec import read_payload
from protocol.envelope import PREFIX
from protocol.errors import PayloadError
from support import reference_codec as ref
from support.malformed_fixtures import (
    BIG,
    BIG_MODEL,
    CONSTANT,
    CONSTANT_MODEL,
    ENCODED,
    MODEL,
    ZSTD,
    ZSTD_MODEL,
    check_valid_or_rejected,
)

Shapes = dict[str, tuple[int, ...]]
SEEDS: tuple[tuple[bytes, Shapes], ...] = (
    (ENCODED, MODEL),
    (CONSTANT, CONSTANT_MODEL),
    (BIG, BIG_MODEL),
    (ZSTD, ZSTD_MODEL),
)


def _recrc(data: bytearray) -> bytes:
    return ref.fix_checksums(bytes(data))


def reframed(rng: random.Random, base: bytes) -> bytes:
    """``base`` with one record's codes replaced by a well-formed zstd frame of edited codes."""
    split = ref.split_payload(base)
    header = {**split.header, "tensors": [list(e) for e in split.header["tensors"]]}
    records = list(split.records)
    framed = [j for j, e in enumerate(header["tensors"]) if e[ref.ZSTD]]
    i = rng.choice(framed) if framed and rng.random() < 0.8 else rng.randrange(len(records))
    stored, unary, rem = records[i]
    entry = header["tensors"][i]
    raw = bytearray(zstandard.ZstdDecompressor().decompress(stored) if entry[ref.ZSTD] else stored)
    for _ in range(rng.randint(0, 3)):
        if raw:
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    if rng.random() < 0.2:
        raw = raw[:-1] if raw and rng.random() < 0.5 else raw + bytes([rng.randrange(256)])
    frame = ref.zstd_frame(
        bytes(raw),
        level=rng.choice([1, 3, 19]),
        content_size=rng.random() < 0.9,
        checksum=rng.random() < 0.3,
    )
    entry[ref.ZSTD] = rng.choice([1] * 8 + [0, 2])
    records[i] = (frame, unary, rem)
    return ref.build_payload(header, records)


def hostile(rng: random.Random) -> tuple[bytes, Shapes]:
    base, model = SEEDS[rng.randrange(len(SEEDS))]
    data = bytearray(base)
    way = rng.randrange(6)
    if way == 5:  # a frame of hostile codes: the frame and codes rules run
        return reframed(rng, base), model
    if way == 0:  # random edits behind valid CRCs: the structural and stream checks run
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(PREFIX.size, len(data))
            data[i] = rng.randrange(256)
        return _recrc(data), model
    if way == 1:  # a bit flip as it arrives
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        return bytes(data), model
    if way == 2:  # a truncation, CRCs recomputed so the header parser and size check see it
        cut = rng.randrange(PREFIX.size, len(data))
        return _recrc(data[:cut]), model
    if way == 3:  # random bytes
        return rng.randbytes(rng.randrange(0, 200)), model
    header = rng.randbytes(rng.randrange(0, 400))  # a valid prefix over a random header
    return ref.wrap_header(header, rng.randbytes(rng.randrange(0, 100))), model


def work(args: tuple[int, int]) -> tuple[int, int, list[str]]:
    seed, count = args
    rng = random.Random(seed)
    rejected, valid, failures = 0, 0, []
    for _ in range(count):
        data, model = hostile(rng)
        try:
            check_valid_or_rejected(data, model)
        except Exception as exc:  # the property broke: keep the input
            failures.append(f"{type(exc).__name__}: {exc} :: {data.hex()}")
            continue
        try:
            read_payload(data, model)
            valid += 1
        except PayloadError:
            rejected += 1
    return rejected, valid, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    chunk = 10_000
    jobs = [
        (args.seed * 1_000_000 + i, min(chunk, args.inputs - i * chunk))
        for i in range((args.inputs + chunk - 1) // chunk)
    ]
    t0 = time.monotonic()
    rejected = valid = 0
    failures: list[str] = []
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        for n, (r, v, f) in enumerate(pool.imap_unordered(work, jobs), 1):
            rejected, valid, failures = rejected + r, valid + v, failures + f
            print(f"\r{min(n * chunk, args.inputs):,} inputs", end="", file=sys.stderr)
    print(file=sys.stderr)
    total = rejected + valid + len(failures)
    print(
        f"{total:,} inputs in {time.monotonic() - t0:.0f} s: {rejected:,} rejected with"
        f" PayloadError, {valid:,} decoded consistently, {len(failures)} failures"
    )
    for line in failures[:20]:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
