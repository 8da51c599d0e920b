"""``python -m coordinator --config run.toml [--host H] [--port P] [--state-dir D]``.

Flags override the environment (``SPARSELOCO_COORD_...``), which overrides the TOML file. A bad
configuration prints the field and the fix and exits with status 2; a clean stop exits 0.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvloop

from coordinator.config import load_config
from coordinator.server import serve
from protocol.errors import ConfigError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m coordinator", description=__doc__)
    parser.add_argument("--config", required=True, help="TOML file (see deploy/run.example.toml)")
    parser.add_argument("--host", help="address to listen on (server.host)")
    parser.add_argument("--port", type=int, help="port, 0 for any free one (server.port)")
    parser.add_argument("--state-dir", help="database, signing key, coordinator.json")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    overrides = {"server": {"host": args.host, "port": args.port, "state_dir": args.state_dir}}
    try:
        config = load_config(args.config, overrides)
        uvloop.run(serve(config))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
