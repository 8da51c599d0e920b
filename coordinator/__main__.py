"""``python -m coordinator --config run.toml [--host H] [--port P] [--state-dir D]``.

Flags override the environment (``SPARSELOCO_COORD_...``), which overrides the TOML file. Before
it writes anything the coordinator binds its port and checks the object store. Exit status: 0
after a clean stop (SIGTERM, Ctrl-C); 2 for a bad configuration (the message names the field and
the fix); 1 when a start-up check fails (port in use, store unreachable, wrong credentials,
missing bucket). No message or log line shows a secret.

``python -m coordinator token add|list|revoke ...`` manages the node tokens in the state
directory, also while the coordinator runs (``coordinator.ops.admin``; ``token --help``).
``python -m coordinator backup|restore ...`` copies the state directory into one file, also while
the coordinator runs, and back into a new state directory (``coordinator.ops.backup_cli``).
``python -m coordinator check-store ...`` (``sparseloco store check``) tries what an object store
keeps of the project's promises (``coordinator.ops.storecheck``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from protocol.version import version_line

#: Set by ``sparseloco coordinator`` so usage lines name the command the operator typed.
PROG_ENV = "SPARSELOCO_PROG"


def prog() -> str:
    return os.environ.get(PROG_ENV) or "python -m coordinator"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog(),
        description="Run the coordinator of one SparseLoCo run. Flags override the"
        " environment (SPARSELOCO_COORD_<SECTION>__<FIELD>), which overrides the TOML file."
        " Before it writes anything it binds the port and checks the object store. Exit status:"
        " 0 after a clean stop (SIGTERM, Ctrl-C), 1 when a start-up check fails, 2 for a bad"
        " configuration.",
        epilog=f"token administration: {prog()} token {{add,list,revoke}} --help; state:"
        f" {prog()} {{backup,restore}} --help; the object store: sparseloco store check --help",
    )
    parser.add_argument("--version", action="version", version=version_line("sparseloco"))
    parser.add_argument("--config", required=True, help="TOML file (see deploy/run.example.toml)")
    parser.add_argument("--host", help="address to listen on (server.host)")
    parser.add_argument("--port", type=int, help="port, 0 for any free one (server.port)")
    parser.add_argument("--state-dir", help="database, signing key, coordinator.json")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["token"]:
        from coordinator.ops.admin import main as token_main

        return token_main(args_in[1:], prog=f"{prog()} token")
    if args_in[:1] in (["backup"], ["restore"]):
        from coordinator.ops.backup_cli import main as backup_main

        return backup_main(args_in[0], args_in[1:], prog=f"{prog()} {args_in[0]}")
    if args_in[:1] == ["check-store"]:
        from coordinator.ops.storecheck import main as check_main

        return check_main(args_in[1:], prog=os.environ.get(PROG_ENV) or f"{prog()} check-store")
    args = parse_args(args_in)
    # The service's libraries are imported only now: the token commands above and ``--help``
    # need none of them, and they take seconds to import on a busy machine.
    import uvloop

    from coordinator.base.config import load_config
    from coordinator.base.errors import StartupError
    from coordinator.base.redact import install, scrub
    from coordinator.ops.server import serve
    from protocol.errors import ConfigError

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    for name in ("botocore", "boto3", "s3transfer", "urllib3"):  # their chatter, not ours
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    overrides = {"server": {"host": args.host, "port": args.port, "state_dir": args.state_dir}}
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    secrets = config.secrets()
    install(secrets)
    try:
        uvloop.run(serve(config))
    except ConfigError as exc:
        print(f"error: {scrub(str(exc), secrets)}", file=sys.stderr)
        return 2
    except StartupError as exc:
        print(f"error: {scrub(str(exc), secrets)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
