"""``python -m node``: the same as the ``sparseloco`` console script."""

import sys

from node.cli import main

sys.exit(main())
