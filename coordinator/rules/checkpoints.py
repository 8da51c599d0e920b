"""Checkpoint rules: which node uploads θ_R, and when a checkpoint counts as committed.

A checkpoint "at round R" holds θ_R, the parameters at the start of round R (after applying
rounds 0..R-1); checkpoint rounds are R > 0 with R % checkpoint_every == 0. Like the round
machine this is synchronous and free of HTTP: every method reads the database, applies the rules
and commits one transaction; the handlers do the object-store calls around it.

Upload grant, checked in this order:

1. ``unknown_round`` (404): R is after the current round;
2. ``not_member`` (409): the node is not an active member (finished, once the run is over) that
   took part in round R-1, whose result θ_R is;
3. ``not_needed`` (409): checkpoints are off, R is 0 or not a multiple of the interval, R (or a
   newer round) already has a committed checkpoint, or another node holds an unexpired grant;
4. ``wrong_fingerprint`` (409): the offered fingerprint is not the majority of the fingerprints
   round R-1's participants reported after applying it (so at least one report is needed);
5. ``too_large`` (413): the file is bigger than ``storage.max_checkpoint_bytes``.

The first eligible node gets the grant for one presign lifetime; asking again with the same body
renews it. Only the holder commits, with the granted body, and only while it is still a member;
the fingerprint is checked against the reports again then. Before the commit is recorded the
handler verifies the stored file itself (``coordinator.store.verify``: size, sha256 and the
fingerprint of its tensors); a file that fails is deleted and its grant dropped (``reject``),
so another node may offer at once. So every committed checkpoint is one the coordinator
verified, and retention may rely on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from coordinator.base.errors import Conflict, TooLarge, UnknownRound
from coordinator.rules.votes import Votes
from coordinator.state.db import Database
from protocol.keys import checkpoint_key
from protocol.messages import CheckpointInfo, CheckpointUpload, MemberState
from protocol.runconfig import RunConfig

log = logging.getLogger("sparseloco.coordinator.checkpoints")


class CheckpointBook:
    """Checkpoint grants and commits over the coordinator's database.

    ``current_round`` says which round is in progress (``RoundMachine.round_number``): no grant
    is given for a later one. ``clock`` is wall time, as in the round machine.
    """

    def __init__(
        self,
        db: Database,
        run: RunConfig,
        *,
        current_round: Callable[[], int],
        prefix: str,
        grant_s: float,
        max_bytes: int,
        clock: Callable[[], float] = time.time,
        votes: Votes | None = None,
    ) -> None:
        self.db = db
        self.run = run
        self.current_round = current_round
        self.prefix = prefix
        self.grant_s = grant_s
        self.max_bytes = max_bytes
        self.clock = clock
        #: The round machine's votes (shared, so reports recorded there count here at once).
        self.votes = votes if votes is not None else Votes(db)

    def key(self, round_: int) -> str:
        return checkpoint_key(self.prefix, self.run.run_id, round_)

    def is_checkpoint_round(self, round_: int) -> bool:
        every = self.run.checkpoint_every
        return every > 0 and round_ > 0 and round_ % every == 0

    def expected_fingerprint(self, round_: int) -> str | None:
        """The majority fingerprint reported after applying round ``round_ - 1``, if any."""
        return self.votes.majority(round_ - 1)

    def _check_member(self, node_id: str, round_: int) -> None:
        """``not_member`` unless ``node_id`` is a live member (finished counts: the run's last
        checkpoint is offered after its end) that took part in round ``round_ - 1``."""
        member = self.db.member(node_id)
        live = member is not None and member.state in (MemberState.ACTIVE, MemberState.FINISHED)
        if not live or node_id not in self.votes.participants(round_ - 1):
            raise Conflict(
                "not_member",
                f"{node_id} is not a member that took part in round {round_ - 1}; only such a"
                f" node may upload θ_{round_}",
            )

    def _check_fingerprint(self, round_: int, offer: CheckpointUpload) -> None:
        expected = self.expected_fingerprint(round_)
        if expected is None:
            raise Conflict(
                "wrong_fingerprint", f"no node has reported round {round_ - 1} yet; retry later"
            )
        if offer.fingerprint != expected:
            raise Conflict(
                "wrong_fingerprint",
                f"θ_{round_} has fingerprint {expected} by the nodes' reports,"
                f" not {offer.fingerprint}",
            )

    def grant(self, node_id: str, round_: int, offer: CheckpointUpload) -> str:
        """Decide (and record) whether ``node_id`` may upload θ_``round_``; the key to PUT.

        See the module doc for the rules. The caller must still remove an object another grant
        left at the key if it is not these bytes (the key is write-once).
        """
        now = self.clock()
        with self.db.tx():
            if round_ > self.current_round():
                raise UnknownRound(round_)
            if round_ > 0:
                self._check_member(node_id, round_)
            if not self.is_checkpoint_round(round_):
                raise Conflict(
                    "not_needed",
                    f"round {round_} is not a checkpoint round"
                    f" (checkpoint_every={self.run.checkpoint_every})",
                )
            newest = self.db.newest_checkpoint()
            if newest is not None and newest.round >= round_:
                raise Conflict(
                    "not_needed", f"round {newest.round} already has a checkpoint (≥ {round_})"
                )
            prior = self.db.grant(round_)
            mine = prior is not None and prior.node_id == node_id
            if prior is not None and not mine and prior.expires_at > now:
                raise Conflict(
                    "not_needed", f"another node is uploading the checkpoint of round {round_}"
                )
            self._check_fingerprint(round_, offer)
            if offer.size > self.max_bytes:
                raise TooLarge(
                    f"size {offer.size} exceeds the checkpoint limit {self.max_bytes}"
                    " (storage.max_checkpoint_bytes)",
                    "size",
                )
            self.db.put_grant(round_, node_id, offer, now + self.grant_s)
        log.info(
            "event=checkpoint_granted round=%d node=%s size=%d renewed=%s",
            round_,
            node_id,
            offer.size,
            mine and prior is not None and prior.body == offer,
        )
        return self.key(round_)

    def committed(
        self, node_id: str, round_: int, offer: CheckpointUpload
    ) -> CheckpointInfo | None:
        """The checkpoint already committed by this very offer (a retry), else ``None``.

        Raises ``not_member`` unless ``node_id`` may still offer it, ``not_granted`` unless it
        holds the grant for exactly ``offer``.
        """
        info = self.db.checkpoint(round_)
        if info is not None and info.node_id == node_id and _same(info, offer):
            return info
        if round_ > 0:
            self._check_member(node_id, round_)
        grant = self.db.grant(round_)
        if info is not None or grant is None or grant.node_id != node_id or grant.body != offer:
            raise Conflict(
                "not_granted", f"{node_id} holds no upload grant for this checkpoint of {round_}"
            )
        return None

    def check_holder(self, node_id: str, round_: int) -> None:
        """``not_granted`` unless ``node_id`` holds the live upload grant of ``round_`` and no
        checkpoint of it is committed yet (completing a multipart upload needs that)."""
        grant = self.db.grant(round_)
        if (
            self.db.checkpoint(round_) is not None
            or grant is None
            or grant.node_id != node_id
            or grant.expires_at <= self.clock()
        ):
            raise Conflict(
                "not_granted", f"{node_id} holds no upload grant for the checkpoint of {round_}"
            )

    def check_offer(self, round_: int, offer: CheckpointUpload) -> None:
        """``wrong_fingerprint`` unless ``offer`` is still the participants' majority."""
        self._check_fingerprint(round_, offer)

    def reject(self, node_id: str, round_: int, why: str) -> None:
        """The file uploaded under ``node_id``'s grant failed verification (the caller deleted
        it): drop the grant, so that the next node that offers θ_``round_`` gets one at once."""
        with self.db.tx():
            self.db.drop_grant(round_)
        log.warning("event=checkpoint_rejected round=%d node=%s why=%s", round_, node_id, why)

    def commit(self, node_id: str, round_: int, offer: CheckpointUpload) -> CheckpointInfo:
        """Record the checkpoint (the caller verified the stored file); idempotent."""
        with self.db.tx():
            prior = self.committed(node_id, round_, offer)
            if prior is not None:
                return prior
            self._check_fingerprint(round_, offer)
            info = CheckpointInfo(
                run_id=self.run.run_id,
                round=round_,
                fingerprint=offer.fingerprint,
                key=self.key(round_),
                sha256=offer.sha256,
                size=offer.size,
                node_id=node_id,
                created_at=self.clock(),
            )
            self.db.add_checkpoint(info)
        log.info(
            "event=checkpoint_committed round=%d node=%s fingerprint=%s size=%d",
            round_,
            node_id,
            info.fingerprint,
            info.size,
        )
        return info

    def latest(self) -> CheckpointInfo | None:
        return self.db.newest_checkpoint()

    def listed(self) -> list[CheckpointInfo]:
        """Every committed checkpoint still in the store (not pruned), newest first."""
        return [row.info for row in self.db.checkpoints() if not row.pruned]


def _same(info: CheckpointInfo, offer: CheckpointUpload) -> bool:
    return (info.size, info.sha256, info.fingerprint) == (
        offer.size,
        offer.sha256,
        offer.fingerprint,
    )
