"""Which process this node is, to the coordinator: a fresh instance id, and its predecessor's.

Every node process draws a random instance id and sends it with each request; the coordinator
binds an active member to it and refuses another process presenting the same token while the
bound one is alive (409 ``token_in_use``; the new process then stops at once,
``node.daemon.join``). A node restarted on its own state directory after a crash is not
"another process" in that sense, and proves it: the id of the process the coordinator last
bound is kept in ``{state_dir}/instance``, and the new process names it when it joins
(``previous_instance``), so it takes over at once instead of waiting out the heartbeat timeout.
A copy started elsewhere (another state directory) cannot know that id and is refused.

The id is recorded only once the coordinator has bound it (``Instance.bound``, after a join
succeeded): a process that stopped before its join went through (the coordinator was down,
Ctrl-C) leaves the bound one's id in place, so the restart after it still takes over at once.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from protocol.messages import INSTANCE_PATTERN

INSTANCE_FILE = "instance"


@dataclass
class Instance:
    """This process's instance id, and the one the coordinator bound before it on this state
    directory (``None``: none that this directory knows of)."""

    state_dir: Path
    id: str
    previous: str | None
    _recorded: bool = False

    def bound(self) -> None:
        """The coordinator bound this node to this process: record the id for the next restart.

        Written atomically (a temporary file, then a rename), so a crash leaves either id whole.
        """
        if self._recorded:
            return
        path = self.state_dir / INSTANCE_FILE
        tmp = path.with_name(INSTANCE_FILE + ".tmp")
        tmp.write_text(self.id + "\n")
        os.replace(tmp, path)
        self._recorded = True


def claim(state_dir: Path) -> Instance:
    """A new instance id for this process and the one the coordinator bound before it here."""
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        previous: str | None = (state_dir / INSTANCE_FILE).read_text().strip()
    except FileNotFoundError:
        previous = None
    if previous is not None and not re.fullmatch(INSTANCE_PATTERN, previous):
        previous = None  # damaged or foreign: worth nothing as proof, and harmless to drop
    return Instance(state_dir, secrets.token_hex(8), previous)
