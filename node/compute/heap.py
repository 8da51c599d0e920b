"""Give large freed blocks back to the system, so a node's resident memory is what it holds.

glibc's ``malloc`` serves a large request with ``mmap`` (returned to the system on ``free``) only
above its mmap threshold, and that threshold *grows* each time such a block is freed, up to
32 MB. A node frees large blocks every step: FSDP gathers a transformer block's parameters (tens
of MB), uses them and frees them; the payload scratch comes and goes. Once the threshold has
grown past them they come from the heap, and freed there they stay resident. Measured on the
81 M benchmark shape with 4 ranks (docs/benchmarks.md §15): one training step grew each rank's RSS
by 1.0 GB instead of the 0.19 GB of its gradients and AdamW moments.

``return_large_blocks`` fixes the threshold (which also stops its growth) at ``THRESHOLD``:
every block of 8 MB or more goes to ``mmap``. 1 MB would return more, but the page faults of
re-mapping activations every step cost a CPU node about a fifth of its training speed; at 8 MB
the speed is unchanged within the noise and the RSS of a 4-rank node's rank falls from 1.7 to
0.94 GB (single process: 2.2 GB). A ``MALLOC_MMAP_THRESHOLD_`` in the environment (glibc's own
knob) wins. Elsewhere than glibc, nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger("sparseloco.heap")

#: Blocks of this many bytes or more are mapped and unmapped on their own.
THRESHOLD = 8 << 20
#: glibc's ``mallopt`` parameter number of the mmap threshold.
M_MMAP_THRESHOLD = -3


def return_large_blocks(threshold: int = THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes; whether it was set."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = bool(mallopt(M_MMAP_THRESHOLD, threshold))
    if not done:
        log.debug("event=mallopt_refused threshold=%d", threshold)
    return done
