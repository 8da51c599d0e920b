"""The manifest key a node trusts: checked against the invite at the first join, pinned after.

Every manifest a node applies must carry a signature by the coordinator's Ed25519 key, and the
node first hears that key in the join response. Taken from there on every start, the key would
be only as trustworthy as the connection: a man in the middle of plain HTTP swaps it and signs
forged gather sets. So:

- with a fingerprint from the operator (``--invite`` or ``--manifest-key-fingerprint``), the
  join response's key must match it, else the node refuses to go on (``Refused``);
- without one, the key of the first join is trusted (trust on first use; the log says so, with
  its fingerprint for the operator to compare);
- either way the trusted key is written to ``{state_dir}/manifest-key`` and every later start
  on that state directory refuses a join response with another key. The daemon verifies every
  manifest with this pinned key, never with the key of a later join response.

A coordinator that really changed its key (its state directory lost) is a new trust decision:
the operator says so, and the participant deletes the file or starts on a new state directory.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from node.errors import Refused, StateError
from protocol.invite import key_fingerprint

log = logging.getLogger("sparseloco.node")

PIN_FILE = "manifest-key"
#: A raw Ed25519 public key in hex, as the join response carries it.
_KEY = re.compile(r"^[0-9a-f]{64}$")


def read_pin(state_dir: Path) -> str | None:
    """The manifest key pinned in ``state_dir`` (hex), or None if none is yet."""
    path = state_dir / PIN_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not _KEY.match(text):
        raise StateError(
            f"{path} is damaged (not a 64-digit hex key), so this node cannot tell which"
            " manifest key it trusted; delete it and start again with the invite (or"
            " --manifest-key-fingerprint) from the run's operator"
        )
    return text


def trusted_key(state_dir: Path, offered: str, expected: str | None, *, node_id: str = "?") -> str:
    """The manifest key to verify with, once ``offered`` (from a join response) passed the
    checks: it matches ``expected`` (``sha256:<hex>``, when given) and the key pinned in
    ``state_dir`` (when there is one); pinned there if it was not yet. ``Refused`` otherwise."""
    offered = offered.strip().lower()
    if not _KEY.match(offered):
        raise Refused(
            "the coordinator's join response carries no valid manifest key: someone may be"
            " intercepting the connection, or this is not a sparseloco coordinator; check the"
            " URL with the run's operator"
        )
    fingerprint = key_fingerprint(offered)
    path = state_dir / PIN_FILE
    if expected is not None and fingerprint != expected:
        raise Refused(
            "the coordinator's manifest key is not the one in your invite: someone may be"
            " intercepting the connection, or the invite is for another coordinator (it offered"
            f" {fingerprint}, the invite names {expected}). Nothing was trained or applied;"
            " check the URL and the invite with the run's operator, and use https://"
            " (deploy/README.md)"
        )
    pinned = read_pin(state_dir)
    if pinned is not None:
        if pinned != offered:
            raise Refused(
                f"the coordinator's manifest key ({fingerprint}) differs from the one this"
                f" node trusted at its first join ({key_fingerprint(pinned)}, in {path}):"
                " someone may be intercepting the connection, or the coordinator lost its state."
                " Ask the run's operator; only if they confirm a new key, delete that file (or"
                " use a new --state-dir) and start again with their new invite"
            )
        return pinned
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(PIN_FILE + ".tmp")
    tmp.write_text(offered + "\n")
    os.replace(tmp, path)
    if expected is None:
        log.warning(
            "event=manifest_key_pinned node=%s source=first_use fingerprint=%s path=%s (no"
            " fingerprint was given, so this first join's key is trusted from now on: compare"
            " it with the operator's)",
            node_id,
            fingerprint,
            path,
        )
    else:
        log.info(
            "event=manifest_key_pinned node=%s source=invite fingerprint=%s", node_id, fingerprint
        )
    return offered
