"""Which process this node is, to the coordinator: a fresh instance id, and its predecessor's.

Every node process draws a random instance id and sends it with each request; the coordinator
binds an active member to it and refuses another process presenting the same token while the
bound one is alive (409 ``token_in_use``). A node restarted on its own state directory after a
crash is not "another process" in that sense, and proves it: the id of the process that ran
there before is kept in ``{state_dir}/instance``, and the new process names it when it joins
(``previous_instance``), so it takes over at once instead of waiting out the heartbeat timeout.
A copy started elsewhere (another state directory) cannot know that id and is refused.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from protocol.messages import INSTANCE_PATTERN

INSTANCE_FILE = "instance"


def claim(state_dir: Path) -> tuple[str, str | None]:
    """A new instance id for this process and the one recorded before it; records the new one.

    Written atomically (a temporary file, then a rename), so a crash leaves either id whole.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / INSTANCE_FILE
    try:
        previous: str | None = path.read_text().strip()
    except FileNotFoundError:
        previous = None
    if previous is not None and not re.fullmatch(INSTANCE_PATTERN, previous):
        previous = None  # damaged or foreign: worth nothing as proof, and harmless to drop
    instance = secrets.token_hex(8)
    tmp = path.with_name(INSTANCE_FILE + ".tmp")
    tmp.write_text(instance + "\n")
    os.replace(tmp, path)
    return instance, previous
