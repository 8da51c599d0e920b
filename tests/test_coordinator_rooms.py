"""The coordinator's rooms (issue 22): every module lives in one, and no room imports upwards.

``coordinator/`` is a package of rooms, one folder per concern, in a fixed order from the bottom
up (``ROOMS``; ``coordinator/__init__.py`` draws the same map). A module may import modules of
its own room and of the rooms below it, never of a room above: so the database never learns of
HTTP, nor the round rules of the object store. Only ``coordinator/__main__.py``, the command
line, sits outside the rooms, above them all.

The import graph is ``tests/test_import_graph.py``'s (parsed with ``ast``, never imported; lazy
and ``TYPE_CHECKING`` imports count).
"""

from __future__ import annotations

import ast
import re

from test_import_graph import ROOT, import_graph

PACKAGE = "coordinator"
#: The rooms, bottom first: each may import its own and those before it.
ROOMS = ("base", "state", "rules", "monitoring", "store", "api", "ops")
#: The modules outside every room: the package itself and the command line (above every room).
OUTSIDE = {PACKAGE: -1, f"{PACKAGE}.__main__": len(ROOMS)}


def _rank(module: str) -> int:
    """The room's place in ``ROOMS`` (``OUTSIDE``'s for the two modules outside them)."""
    if module in OUTSIDE:
        return OUTSIDE[module]
    return ROOMS.index(module.split(".")[1])


def _coordinator_modules() -> dict[str, set[str]]:
    graph, _ = import_graph()
    return {
        name: {t for t in targets if t.split(".")[0] == PACKAGE}
        for name, targets in graph.items()
        if name.split(".")[0] == PACKAGE
    }


def test_every_module_lives_in_a_room() -> None:
    modules = _coordinator_modules()
    assert len(modules) > 40, sorted(modules)  # the walk found the coordinator
    homeless = sorted(
        name
        for name in modules
        if name not in OUTSIDE
        and not (len(name.split(".")) in (2, 3) and name.split(".")[1] in ROOMS)
    )
    assert not homeless, f"modules in no room (or nested below one): {homeless}"
    folders = {p.name for p in (ROOT / PACKAGE).iterdir() if (p / "__init__.py").exists()}
    assert folders == set(ROOMS), f"packages that are not rooms: {sorted(folders - set(ROOMS))}"


def test_rooms_are_docstrings_only() -> None:
    """A room's ``__init__.py`` says what lives there and imports nothing; it names every
    module of its room."""
    for room in ROOMS:
        path = ROOT / PACKAGE / room / "__init__.py"
        body = ast.parse(path.read_text(encoding="utf-8")).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), f"{path}: a docstring only"
        doc = ast.get_docstring(ast.Module(body=body, type_ignores=[])) or ""
        files = sorted(p.name for p in path.parent.glob("*.py") if p.name != "__init__.py")
        unnamed = [f for f in files if f not in doc]
        assert not unnamed, f"{path} does not name {unnamed}"


def test_no_room_imports_a_room_above_its_own() -> None:
    upward = [
        f"{source} ({source.split('.')[1]}) -> {target}"
        for source, targets in sorted(_coordinator_modules().items())
        for target in sorted(targets)
        if _rank(target) > _rank(source)
    ]
    assert not upward, "imports of a room above the importer's own:\n" + "\n".join(upward)


def test_the_package_map_lists_the_rooms_in_order() -> None:
    doc = ast.get_docstring(ast.parse((ROOT / PACKAGE / "__init__.py").read_text())) or ""
    listed = re.findall(r"^    (\w+)/ ", doc, flags=re.M)
    assert tuple(listed) == ROOMS, listed
