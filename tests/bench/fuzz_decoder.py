"""Fuzz the payload decoder by hand: millions of hostile inputs, every outcome checked.

    python tests/bench/fuzz_decoder.py --inputs 1000000 [--workers 2] [--seed 0]

Each input starts from one of three valid payloads (small, zstd-compressed, larger) and is
broken one of several ways: random byte edits behind a recomputed CRC (so the deep checks run),
bit flips and truncations as they arrive (the CRC must catch them), random bytes, or a valid
header over random body bytes. Every input is decoded three ways (eager, lazy as the node reads
peers, dense); each must either raise ``PayloadError`` naming a field, or give a payload that
is consistent (positions inside their tiles and increasing, codes in range, finite values), and
lazy and eager must reach the same verdict. Anything else (another exception, a hang, a crash)
is a failure, printed with the input in hex so it can become a test. The CI run of the same
properties is hypothesis, in ``tests/test_codec_malformed*.py``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for ``support``

from protocol.codec import read_payload
from protocol.envelope import HEADER, MAGIC, VERSION
from protocol.errors import PayloadError
from support.malformed_fixtures import (
    BIG,
    BIG_MODEL,
    ENCODED,
    MODEL,
    ZMODEL,
    ZSTD_SMALL,
    check_valid_or_rejected,
)

Shapes = dict[str, tuple[int, ...]]
SEEDS: tuple[tuple[bytes, Shapes], ...] = (
    (ENCODED, MODEL),
    (ZSTD_SMALL, ZMODEL),
    (BIG, BIG_MODEL),
)


def _recrc(data: bytearray) -> bytes:
    body = bytes(data[HEADER.size :])
    magic, version, flags, _ = HEADER.unpack_from(bytes(data[: HEADER.size]))
    return HEADER.pack(magic, version, flags, zlib.crc32(body)) + body


def hostile(rng: random.Random) -> tuple[bytes, Shapes]:
    base, model = SEEDS[rng.randrange(len(SEEDS))]
    data = bytearray(base)
    way = rng.randrange(5)
    if way == 0:  # random edits behind a valid CRC: the structural and stream checks run
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(HEADER.size, len(data))
            data[i] = rng.randrange(256)
        return _recrc(data), model
    if way == 1:  # a bit flip as it arrives
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        return bytes(data), model
    if way == 2:  # a truncation, CRC recomputed so the body parser sees it
        cut = rng.randrange(HEADER.size, len(data))
        return _recrc(data[:cut]), model
    if way == 3:  # random bytes
        return rng.randbytes(rng.randrange(0, 200)), model
    body = rng.randbytes(rng.randrange(0, 400))  # a valid header over a random body
    flags = rng.choice((0, 1))
    return HEADER.pack(MAGIC, VERSION, flags, zlib.crc32(body)) + body, model


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
