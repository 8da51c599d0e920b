"""``bench node-work``'s flags (``node.research.bench.node_work``), shared by ``sparseloco bench``
(``node.research.bench.cli``) and ``python -m node.research.bench.node_work``; apart from the
benchmark so that ``--help`` reads them without importing torch.
"""

from __future__ import annotations

import argparse


def add_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The command's flags; ``p`` is returned for chaining."""
    p.add_argument("--preset", help="model preset (default: the 81 M benchmark shape)")
    p.add_argument("--ranks", default="1,2,4", help="rank counts to measure (default 1,2,4)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peers", type=int, default=16)
    p.add_argument("--train-steps", type=int, default=0, help="real inner steps a round (0: none)")
    p.add_argument("--batch-size", type=int, default=4, help="the node's batch (>= every ranks)")
    p.add_argument("--ctx-len", type=int, help="another context length for the model")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--state-dir", help="where the state files go (default: a temp dir)")
    p.add_argument("--json", dest="json_out", metavar="OUT")
    return p
