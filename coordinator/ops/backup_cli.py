"""``sparseloco coordinator backup|restore``: the operator's copy of a coordinator, and its return.

- ``backup --config run.toml --out FILE`` (or ``--state-dir DIR``) writes a consistent snapshot
  of the coordinator's state to FILE, also while the coordinator runs
  (``coordinator.state.backup``): one gzipped tar, mode 0600, replaced atomically, so a cron job may
  overwrite the last one. stdout says what it holds (run, round, the key's public fingerprint);
  never the key.
- ``restore --from FILE --state-dir DIR`` (or ``--config`` naming the state directory) unpacks
  it into a new state directory. Then start the coordinator there with the run's config, on
  the address nodes know: it takes the rounds closed after the backup from the store
  (``coordinator.store.catchup``) and the nodes carry on.

Exit status: 0 done; 1 refused (no state to back up, a damaged archive, a state directory that
already holds a database); 2 a usage or config error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from coordinator.base.config_file import state_dir_of
from coordinator.base.errors import BackupError
from coordinator.state.backup import restore_backup, take_backup
from protocol.errors import ConfigError


def build_parser(prog: str, action: str) -> argparse.ArgumentParser:
    if action == "backup":
        parser = argparse.ArgumentParser(
            prog=prog,
            description="Write a consistent snapshot of a coordinator's state (database and"
            " manifest signing key) to one file, mode 0600; also while it runs.",
        )
        parser.add_argument(
            "--out", required=True, metavar="FILE", help="the backup file to write (replaced)"
        )
        where = "the state directory to back up"
    else:
        parser = argparse.ArgumentParser(
            prog=prog,
            description="Unpack a backup into a new state directory; then start the"
            " coordinator on it with the run's config (same address): it learns the rounds"
            " closed since the backup from the store, and nodes carry on.",
        )
        parser.add_argument(
            "--from", dest="archive", required=True, metavar="FILE", help="a file from `backup`"
        )
        where = "the new state directory to restore into (must hold no database)"
    parser.add_argument("--state-dir", metavar="DIR", help=where)
    parser.add_argument("--config", help="the coordinator's TOML config (for its state_dir)")
    return parser


def main(action: str, argv: Sequence[str], *, prog: str) -> int:
    args = build_parser(prog, action).parse_args(argv)
    try:
        state_dir = state_dir_of(args.config, args.state_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if action == "backup":
            out = Path(args.out)
            info = take_backup(state_dir, out)
            print(f"backup of {info.describe()} written to {out} (mode 0600: it holds the key)")
        else:
            info = restore_backup(Path(args.archive), state_dir)
            print(
                f"restored {info.describe()} into {state_dir}; start the coordinator on it with"
                f" the run's config (--state-dir {state_dir}) where nodes reach it: it takes the"
                " rounds closed since the backup from the store"
            )
    except BackupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
