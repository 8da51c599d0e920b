"""``node.compute.heap``: large freed blocks go back to the system (glibc), so RSS means held.

In a fresh process (the threshold is per process), blocks of 24 MB allocated, touched and freed
again and again: with ``return_large_blocks`` each one is unmapped on free, so the resident set
ends where it began. Without it, glibc's threshold grows past them after the first and they may
stay resident; that part is glibc's behaviour, not checked here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

PROGRAM = """
from pathlib import Path
from node.compute.heap import return_large_blocks

def rss_mb():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

print(return_large_blocks())
before = rss_mb()
for _ in range(8):
    block = bytearray(24 << 20)  # zero-filled: every page touched
    block[::4096] = b"x" * len(block[::4096])
    del block
print(rss_mb() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_large_blocks_leave_the_resident_set() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, check=True
    )
    set_, grown = done.stdout.split()
    assert set_ == "True"
    assert float(grown) < 8.0, f"RSS grew by {grown} MB over 8 blocks of 24 MB"
