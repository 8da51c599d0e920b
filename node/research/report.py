"""How the research commands hand back what they measured: a table printed, a JSON file written.

``write_json`` writes a document atomically (a crash never leaves half a file), making its folder
first. ``publish`` is how every ``sparseloco bench`` command ends: print its table, and with
``--json OUT`` write its whole report there and say so. Kept free of torch, so that a command's
report can be written by code that never loads a model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(document: Any, path: str | Path) -> None:
    """Write ``document`` to ``path`` as indented JSON, atomically, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    tmp.replace(path)


def publish(table: str, report: Any, json_out: str | Path | None) -> None:
    """Print ``table``; with ``json_out``, write ``report`` there and print where it went."""
    print(table)
    if json_out:
        write_json(report, json_out)
        print(f"wrote {json_out}")
