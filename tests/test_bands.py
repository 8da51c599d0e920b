"""The codec's parallel loops (``node.compute.bands``): how many threads they may use."""

from __future__ import annotations

import numba
import torch

from node.compute.bands import limit_threads


def test_threads_bound_torch_and_the_codecs_pool() -> None:
    """``--threads`` of a node started by hand bounds numba's pool too (before, only
    ``sparseloco up``'s NUMBA_NUM_THREADS did)."""
    torch_before, numba_before = torch.get_num_threads(), numba.get_num_threads()
    try:
        limit_threads(1)
        assert (torch.get_num_threads(), numba.get_num_threads()) == (1, 1)
    finally:
        torch.set_num_threads(torch_before)
        numba.set_num_threads(numba_before)
