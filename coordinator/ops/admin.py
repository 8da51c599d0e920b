"""``sparseloco coordinator token add|list|revoke``: the operator decides who may take part.

Works on the coordinator's database in its state directory, named by ``--state-dir DIR`` or by
the config (``--config run.toml``: its ``[server] state_dir``, or the environment's, as the
coordinator itself reads it; nothing else of the config is needed, not even store credentials).
It runs beside a running coordinator: SQLite serialises the writes, and the coordinator notices
every change within a request or a tick (``coordinator.rules.tokens``):

- ``add NODE_ID`` makes a new random token, stores only its digest, and prints the token once on
  stdout (the explanation goes to stderr, so ``TOKEN=$(... token add n5)`` captures just it). A
  node that already holds an active token is refused: revoke it first. With ``--invite`` stdout
  is instead one invite string (``protocol.invite``: the coordinator's URL, the token and the
  fingerprint of the manifest key; ``--url`` names the public address, ``coordinator.ops.invite``).
  stdout stays one value either way, and stderr never carries the token (it is often logged);
  without ``--invite`` stderr shows the fingerprint for ``--manifest-key-fingerprint``.
- ``list`` prints every token's node, state, source, creation, last use and revocation, never
  a token.
- ``revoke NODE_ID`` revokes the node's active tokens: its next request, at the latest its next
  heartbeat, is answered 401 ``token_revoked`` (the node then stops), and a running coordinator
  takes it out of the run within a tick (an open round stops waiting for it; its live figures
  leave ``/metrics``). A config token revoked this way stays revoked at the next start.

These commands import no more than the database needs (``coordinator.base.config_file``, not the
server's libraries), so they answer in a fraction of a second even on a busy machine: a revoke is
what an operator runs when it is urgent.

Exit status: 0 done; 1 refused (nothing to revoke, already has a token); 2 a usage or config
error (no database in that state directory).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from coordinator.base.config_file import state_dir_of
from coordinator.base.errors import TokenAdminError
from coordinator.rules.tokens import (
    TokenRow,
    TokenSource,
    TokenState,
    TokenTable,
    digest,
    new_token,
)
from coordinator.state.db import Database
from coordinator.state.schema import DB_FILE
from protocol.errors import ConfigError
from protocol.keys import check_id


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Add, list or revoke node tokens in a coordinator's state directory (also"
        " while it runs).",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="{add,list,revoke}")
    add = actions.add_parser("add", help="issue a new token for a node and print it once")
    add.add_argument("node_id", help="the node's id (1-64 of A-Z a-z 0-9 _ . -)")
    add.add_argument(
        "--invite",
        action="store_true",
        help="print one invite string (URL, token, manifest key fingerprint) instead of the"
        " bare token: give it to the participant for `sparseloco node --invite`",
    )
    add.add_argument(
        "--url",
        help="the coordinator URL participants reach, for the invite (default: from [server])",
    )
    listing = actions.add_parser("list", help="every token's node, state and dates (no tokens)")
    revoke = actions.add_parser("revoke", help="revoke a node's token; the node is out at once")
    revoke.add_argument("node_id")
    for sub in (add, listing, revoke):
        sub.add_argument("--state-dir", help="the coordinator's state directory")
        sub.add_argument("--config", help="the coordinator's TOML config (for its state_dir)")
    return parser


def open_database(state_dir: Path) -> Database:
    """The coordinator database in ``state_dir``; refuse to create one where there is none."""
    path = state_dir / DB_FILE
    if not path.is_file():
        raise TokenAdminError(
            f"no coordinator database at {path}: start the coordinator once with this state"
            " directory, or fix --state-dir / --config"
        )
    return Database(path)


def add(table: TokenTable, node_id: str, now: float) -> str:
    """A new token for ``node_id`` (its digest stored); refused if it holds an active one."""
    try:
        check_id("node id", node_id)
    except ValueError as exc:
        raise TokenAdminError(str(exc)) from exc
    with table.db.tx():
        active = [r for r in table.of(node_id) if r.state == TokenState.ACTIVE]
        if active:
            raise TokenAdminError(
                f"{node_id} already has an active token (created {_when(active[0].created_at)});"
                f" revoke it first: token revoke {node_id}"
            )
        token = new_token()
        table.add(node_id, digest(token), TokenSource.CLI, now)
    return token


def revoke(table: TokenTable, node_id: str, now: float) -> int:
    """Revoke ``node_id``'s active tokens; refused if it has none."""
    with table.db.tx():
        n = table.revoke(node_id, now)
    if n == 0:
        known = sorted({r.node_id for r in table.rows()})
        raise TokenAdminError(
            f"{node_id} has no active token (nodes with tokens: {', '.join(known) or 'none'})"
        )
    return n


def render(rows: Sequence[TokenRow]) -> str:
    """The ``list`` table: one line per token, no token."""
    header = ("NODE", "STATE", "SOURCE", "CREATED", "LAST USED", "REVOKED")
    lines = [header] + [
        (
            r.node_id,
            r.state.value,
            r.source.value,
            _when(r.created_at),
            _when(r.last_used),
            _when(r.revoked_at),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


def _add(table: TokenTable, args: argparse.Namespace, state_dir: Path) -> None:
    """``token add``: the token (or the invite) on stdout, what to do with it on stderr."""
    # Imported here: the signing key's library is only for ``add``; ``list`` and ``revoke``
    # stay quick to start (see the module docstring).
    from coordinator.ops.invite import manifest_key_fingerprint, public_url
    from protocol.invite import Invite

    fingerprint = manifest_key_fingerprint(state_dir)
    # The URL is worked out before the token exists: a bad --url must not use up a token.
    url = public_url(args.url, args.config, state_dir) if args.invite else None
    token = add(table, args.node_id, time.time())
    if url is not None:
        print(Invite(coordinator=url, token=token, manifest_key=fingerprint).encode())
        print(
            f"invite for {args.node_id} ({url}, manifest key {fingerprint}); shown only now,"
            " and it holds the token: give it to the node's operator privately, for"
            " `sparseloco node --invite ...` (or SPARSELOCO_NODE_INVITE=...)",
            file=sys.stderr,
        )
        return
    print(token)
    print(
        f"new token for {args.node_id} in {state_dir}; shown only now: give it to the node's"
        f" operator (SPARSELOCO_NODE_TOKEN=...) with the manifest key fingerprint {fingerprint}"
        " (--manifest-key-fingerprint); --invite puts URL, token and fingerprint in one string",
        file=sys.stderr,
    )


def main(argv: Sequence[str], *, prog: str = "python -m coordinator token") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        state_dir = state_dir_of(args.config, args.state_dir)
        db = open_database(state_dir)
    except (ConfigError, TokenAdminError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = TokenTable(db)
    try:
        if args.action == "add":
            _add(table, args, state_dir)
        elif args.action == "list":
            rows = table.rows()
            print(render(rows) if rows else f"no tokens in {state_dir}")
        else:
            n = revoke(table, args.node_id, time.time())
            print(
                f"revoked {n} token{'s' if n > 1 else ''} of {args.node_id}; a running"
                " coordinator refuses it at once and takes the node out of the run; the node"
                " stops at its next heartbeat"
            )
    except TokenAdminError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:  # a damaged signing key, an unreadable config for the invite
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        db.close()
    return 0
