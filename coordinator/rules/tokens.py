"""Node tokens: kept hashed in the coordinator's database, checked on every request.

A node proves who it is with a bearer token. Tokens are long random strings, so the database
keeps only their sha256 (a slow password hash buys nothing against a 192-bit secret). A token
presented for the first time is compared with every stored digest by ``hmac.compare_digest``,
with no early exit, so the time does not say which digest (if any) it matched. A token that
authenticated once is remembered by its digest (until the tokens change), and its next requests
cost one dictionary lookup and one comparison instead of one per stored token (a thousand at a
thousand nodes, the largest cost of a heartbeat). That fast path only ever serves tokens the
caller already holds and was already told are valid: a guessed token always takes the full
comparison.

Where tokens come from, and the rule between the two sources:

- the config's ``[tokens]`` table seeds the database at every start, but only for node ids the
  database has never held a token for. Once a node has a token row (active or revoked, from
  the config or from the command line), the database decides: a revoked config token stays
  revoked, and a changed config token for that node is ignored; both are logged at start with
  the command that does what the operator probably meant;
- ``sparseloco coordinator token add|list|revoke`` (``coordinator.ops.admin``) changes the database
  directly, from another process, while the coordinator runs.

Each change bumps a counter in ``meta`` (``tokens_version``). The running server holds the rows in
memory and reloads them when the counter moved. It reads the counter on an authenticated request
only when the database changed since it last looked: SQLite's ``data_version`` moves when
another connection commits, and the connection's own ``meta`` writes are counted beside it,
so a request costs one pragma instead of a query (at 1,000 nodes, most requests of a round
find nothing changed); its ticker then takes every member whose token was revoked out of the run.
When a token was last used is noted in memory and written by the ticker: at once for a token's
first use since the start, then at most every ``LAST_USED_FLUSH_S``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from coordinator.base.errors import ApiError
from coordinator.state.db import Database

log = logging.getLogger("sparseloco.coordinator.tokens")

#: Random bytes in a token made by ``token add`` (32 URL-safe characters).
TOKEN_BYTES = 24
#: Meta key of the counter every token change bumps.
VERSION_KEY = "tokens_version"
#: Seconds between writes of the tokens' last-use times.
LAST_USED_FLUSH_S = 10.0


class TokenState(StrEnum):
    ACTIVE = "active"
    REVOKED = "revoked"


class TokenSource(StrEnum):
    CONFIG = "config"  # seeded from the config's [tokens] table
    CLI = "cli"  # made by `sparseloco coordinator token add`


@dataclass(frozen=True)
class TokenRow:
    """One issued token, without the token: its digest, whose it is, and its history."""

    digest: str
    node_id: str
    state: TokenState
    source: TokenSource
    created_at: float
    revoked_at: float | None
    last_used: float | None


def new_token() -> str:
    """A fresh bearer token from the operating system's random source."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def digest(token: str) -> str:
    """The hex sha256 of ``token``: what the database keeps."""
    return hashlib.sha256(token.encode()).hexdigest()


class TokenTable:
    """Typed reads and writes of the ``tokens`` table; writes join the caller's transaction."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def rows(self) -> list[TokenRow]:
        """Every token ever issued, by node id and age."""
        cur = self.db.execute(
            "SELECT hash, node_id, state, source, created_at, revoked_at, last_used FROM tokens"
            " ORDER BY node_id, created_at"
        )
        return [
            TokenRow(r[0], r[1], TokenState(r[2]), TokenSource(r[3]), r[4], r[5], r[6]) for r in cur
        ]

    def of(self, node_id: str) -> list[TokenRow]:
        return [row for row in self.rows() if row.node_id == node_id]

    def version(self) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (VERSION_KEY,)).fetchone()
        return 0 if row is None else int(row[0])

    def _bump(self) -> None:
        self.db.set_meta(VERSION_KEY, str(self.version() + 1))

    def add(self, node_id: str, token_digest: str, source: TokenSource, now: float) -> None:
        self.db.execute(
            "INSERT INTO tokens(hash, node_id, state, source, created_at) VALUES(?,?,?,?,?)",
            (token_digest, node_id, TokenState.ACTIVE.value, source.value, now),
        )
        self._bump()

    def revoke(self, node_id: str, now: float) -> int:
        """Revoke every active token of ``node_id``; how many there were."""
        cur = self.db.execute(
            "UPDATE tokens SET state=?, revoked_at=? WHERE node_id=? AND state=?",
            (TokenState.REVOKED.value, now, node_id, TokenState.ACTIVE.value),
        )
        if cur.rowcount:
            self._bump()
        return int(cur.rowcount)

    def note_used(self, used: Mapping[str, float]) -> None:
        """Record when each token (by digest) was last used; not a change anyone waits for."""
        self.db.executemany(
            "UPDATE tokens SET last_used=MAX(COALESCE(last_used, 0), ?) WHERE hash=?",
            [(when, token_digest) for token_digest, when in used.items()],
        )

    def seed(self, config_tokens: Mapping[str, str], now: float) -> None:
        """Add the config's tokens by the rule in the module docstring; log what was skipped."""
        with self.db.tx():
            by_digest = {r.digest: r for r in self.rows()}
            holders = {r.node_id for r in by_digest.values()}
            for node_id, token in config_tokens.items():
                token_digest = digest(token)
                same = by_digest.get(token_digest)
                mine = node_id in holders
                if same is not None and same.node_id != node_id:
                    log.warning(
                        "event=config_token_ignored node=%s reason=%s",
                        node_id,
                        f"the database holds this token for {same.node_id}",
                    )
                elif same is not None and same.state == TokenState.REVOKED:
                    log.warning(
                        "event=config_token_revoked node=%s fix=%s",
                        node_id,
                        f"it stays revoked; remove it from [tokens], and issue a new one with"
                        f" `sparseloco coordinator token add {node_id}`",
                    )
                elif same is None and mine:
                    log.warning(
                        "event=config_token_ignored node=%s fix=%s",
                        node_id,
                        "the database already holds this node's tokens; change them with"
                        f" `sparseloco coordinator token revoke|add {node_id}`",
                    )
                elif same is None:
                    self.add(node_id, token_digest, TokenSource.CONFIG, now)
                    holders.add(node_id)
                    by_digest[token_digest] = TokenRow(
                        token_digest,
                        node_id,
                        TokenState.ACTIVE,
                        TokenSource.CONFIG,
                        now,
                        None,
                        None,
                    )
                    log.info("event=token_seeded node=%s source=config", node_id)


class TokenBook:
    """The running server's view of the tokens: cached rows, reloaded when the counter moves."""

    def __init__(self, db: Database, *, clock: Callable[[], float] = time.time) -> None:
        self.table = TokenTable(db)
        self.clock = clock
        self._version = -1
        #: (data_version, own meta writes) when the counter was last read.
        self._looked: tuple[int, int] | None = None
        self._rows: list[TokenRow] = []
        #: Digests that authenticated since the last reload (the fast path; active tokens only).
        self._known: dict[str, TokenRow] = {}
        self._revoked: set[str] = set()  # digests known to be revoked
        #: Nodes with a token revoked since ``take_revoked`` was last called.
        self._newly_revoked: set[str] = set()
        self._used: dict[str, float] = {}
        self._written: set[str] = set()  # digests whose use this process has written once
        self._flushed_at = clock()
        self._reload()
        self._newly_revoked.clear()  # revocations before this start are the machine's to apply

    def _reload(self) -> None:
        db = self.table.db
        looked = (db.data_version(), db.meta_writes)
        if looked == self._looked:
            return
        self._looked = looked
        version = self.table.version()
        if version == self._version:
            return
        self._rows = self.table.rows()
        self._known = {}
        self._version = version
        revoked = {r.digest for r in self._rows if r.state == TokenState.REVOKED}
        fresh = revoked - self._revoked
        self._newly_revoked |= {r.node_id for r in self._rows if r.digest in fresh}
        self._revoked = revoked

    def authenticate(self, token: str) -> str:
        """The node id of ``token``; 401 ``unauthorized`` or ``token_revoked`` otherwise."""
        self._reload()
        presented = digest(token)
        known = self._known.get(presented)
        if known is not None and hmac.compare_digest(presented, known.digest):
            self._used[known.digest] = self.clock()
            return known.node_id
        match: TokenRow | None = None
        for row in self._rows:  # every row, no early exit: the time does not depend on a match
            if hmac.compare_digest(presented, row.digest):
                match = row
        if match is None:
            raise ApiError(
                401, "unauthorized", "send Authorization: Bearer <token> with a token issued"
                " for this run (config [tokens] or `sparseloco coordinator token add`)"
            )  # fmt: skip
        if match.state == TokenState.REVOKED:
            raise ApiError(
                401,
                "token_revoked",
                f"the token of {match.node_id} was revoked by the run's operator; stop this"
                " node and ask the operator for a new token",
            )
        self._used[match.digest] = self.clock()
        self._known[match.digest] = match
        return match.node_id

    def active_nodes(self) -> set[str]:
        """Nodes holding at least one active token."""
        self._reload()
        return {r.node_id for r in self._rows if r.state == TokenState.ACTIVE}

    def revoked_nodes(self) -> set[str]:
        """Nodes with a revoked token and no active one."""
        self._reload()
        revoked = {r.node_id for r in self._rows if r.state == TokenState.REVOKED}
        return revoked - self.active_nodes()

    def take_revoked(self) -> set[str]:
        """Nodes whose token was revoked since the last call (the ticker takes them out)."""
        self._reload()
        out, self._newly_revoked = self._newly_revoked, set()
        return out

    def flush_used(self, *, force: bool = False) -> None:
        """Write the last-use times: a first use at once, later ones every ``LAST_USED_FLUSH_S``."""
        now = self.clock()
        first_use = not self._used.keys() <= self._written
        due = force or first_use or now - self._flushed_at >= LAST_USED_FLUSH_S
        if not self._used or not due:
            return
        used, self._used = self._used, {}
        with self.table.db.tx():
            self.table.note_used(used)
        self._written |= used.keys()
        self._flushed_at = now
