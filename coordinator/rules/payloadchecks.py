"""Which submissions of the open round still wait for their stored object to be confirmed.

A submission names the size and sha256 of the payload its node uploaded. The coordinator used
to HEAD the object before answering; at 1,000 nodes a round, against a store on the same
machine, that HEAD was the largest single cost of a submit (docs/benchmarks.md §11). Now a
submission whose digest is the one and only digest this process granted an upload of at its
key is answered at once and confirmed later, with every other such submission of the round, by
one listing of the round's folder (``coordinator.api.confirm``); the round does not close
while one is unconfirmed. Confirming size alone is enough there: the presigned PUT (or each
presigned part) was bound to that size and sha256, and the store refuses other bytes
(SECURITY.md). An object that is missing or of another size is HEADed once more, and if it
still does not match, the submission is rejected as a bad digest, as it would have been at the
submit; the manifest excludes it for that reason.

Every other submission (no grant seen by this process, or grants of several digests at one
key: a restart, or a node changing its payload) is HEADed before its answer, as before.

Kept in memory for the open round only. After a restart every accepted submission of the open
round counts as unconfirmed again (``RoundMachine`` refills it), which costs one listing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: What is known of the grants at one payload key: the one (sha256, size) granted, or
#: ``None`` once grants of two different payloads were handed out there.
Granted = tuple[str, int] | None


@dataclass
class PayloadChecks:
    """Grants handed out and submissions unconfirmed, for one round at a time."""

    #: The round the sets below are about; an older round's entries are dropped on sight.
    round: int = -1
    granted: dict[str, Granted] = field(default_factory=dict)
    #: node id -> the size its submission names, accepted and not yet confirmed
    unconfirmed: dict[str, int] = field(default_factory=dict)
    #: Whether a close is held for them (the confirmer's cue).
    wanted: bool = False

    def _at(self, round_: int) -> bool:
        """Move to ``round_`` if it is newer; whether ``round_`` is the round kept."""
        if round_ > self.round:
            self.round, self.granted, self.unconfirmed, self.wanted = round_, {}, {}, False
        return round_ == self.round

    def grant(self, round_: int, node_id: str, sha256: str, size: int) -> None:
        """An upload of ``size`` bytes hashing to ``sha256`` was granted at the node's key."""
        if not self._at(round_):
            return
        seen = self.granted.get(node_id, (sha256, size))
        self.granted[node_id] = seen if seen == (sha256, size) else None

    def trusts(self, round_: int, node_id: str, sha256: str, size: int) -> bool:
        """Whether the only payload granted at the node's key is this one (then the object
        there, if it has this size, is it)."""
        return self._at(round_) and self.granted.get(node_id) == (sha256, size)

    def defer(self, round_: int, node_id: str, size: int) -> None:
        """An accepted submission whose object is to be confirmed before the round closes."""
        if self._at(round_):
            self.unconfirmed[node_id] = size

    def pending(self, round_: int) -> dict[str, int]:
        """Unconfirmed submissions of ``round_``: node id -> the size it names."""
        return dict(self.unconfirmed) if self._at(round_) else {}

    def settle(self, round_: int, nodes: set[str]) -> None:
        """``nodes``' objects were checked (either way)."""
        if self._at(round_):
            for node in nodes:
                self.unconfirmed.pop(node, None)
            self.wanted = bool(self.unconfirmed) and self.wanted


@dataclass
class PartKeys:
    """The key each multipart upload of a payload was granted at, by (round, node, upload id):
    with write-once by naming the key depends on the payload's sha256, which a completion does
    not repeat. Kept for the newest round only; a completion this process did not grant (it
    restarted meanwhile) is refused, and the node uploads again."""

    keys: dict[tuple[int, str, str], str] = field(default_factory=dict)

    def remember(self, round_: int, node_id: str, upload_id: str, key: str) -> None:
        for old in [k for k in self.keys if k[0] < round_]:
            del self.keys[old]
        self.keys[(round_, node_id, upload_id)] = key

    def key(self, round_: int, node_id: str, upload_id: str) -> str | None:
        return self.keys.get((round_, node_id, upload_id))
