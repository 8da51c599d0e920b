"""``python -m support.parts_node THRESHOLD node [flags]``: ``sparseloco node`` whose payloads of
``THRESHOLD`` bytes or more go to the store in parts.

The product's command line and daemon, unchanged, with ``node.daemon.multipart``'s threshold
lowered (64 MiB by default, far above a test model's payload): every upload of that size or more
is a multipart upload (create, presigned parts, completion) through the coordinator, as a
payload of a large model is. ``support.cluster.Cluster.start_wrapped_node`` starts it with
``tests/`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from node import cli
from node.daemon import multipart


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or not args[0].isdigit():
        print("usage: python -m support.parts_node THRESHOLD node [flags]")
        return 2
    multipart.MULTIPART_THRESHOLD = int(args.pop(0))
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
