"""``python -m support.hostile_node KIND node [flags]``: ``sparseloco node`` as a hostile node.

The product's command line, settings and exit statuses, unchanged, with one difference: the
daemon runs with its seams wrapped (``support.hostile``), sending ``KIND``'s payloads
(``node.research.bench.hostile.KINDS``). ``support.cluster.Cluster.start_node`` starts it with
``tests/`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from node import cli
from node.daemon import serve
from node.daemon.settings import NodeSettings
from node.research.bench.hostile import KINDS
from support.hostile import run_hostile_node


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in KINDS:
        print(f"usage: python -m support.hostile_node {{{','.join(KINDS)}}} node [flags]")
        return 2
    kind = args.pop(0)

    def run_node(settings: NodeSettings) -> int:
        return run_hostile_node(settings, kind)

    # ``sparseloco node`` looks ``run_node`` up when it runs: this process runs the hostile one.
    serve.run_node = run_node
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
