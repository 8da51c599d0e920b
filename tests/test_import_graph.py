"""No import circle anywhere in the product (issue 22).

Every ``.py`` under ``protocol/``, ``node/`` and ``coordinator/`` is parsed with ``ast``, never
imported, and every import statement in it counts: at module level, inside functions (the lazy
imports), and under ``if TYPE_CHECKING:`` (a circle only the type checker sees is still a circle
in the design). Relative imports are resolved, and ``from pkg import name`` points at
``pkg.name`` when that is a module. An import edge goes to the most specific product module named;
the implicit import of the parent packages is left out (their ``__init__`` files import nothing).

A circle is reported as the chain ``a -> b -> a``, the shortest first: for each import edge that
lies on a circle, the shortest circle through it.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "node", "coordinator")

Graph = dict[str, set[str]]


class Import(NamedTuple):
    target: str  # the dotted module name the statement imports
    line: int
    resolved: bool  # ``target`` is a module of the product


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _product_files() -> dict[str, Path]:
    files: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            files[_module_name(path)] = path
    return files


def _is_product(name: str) -> bool:
    return name.split(".", 1)[0] in PACKAGES


def _imports(module: str, is_package: bool, tree: ast.AST, modules: set[str]) -> Iterator[Import]:
    """Every product import in ``tree``, resolved: ``import a.b`` and ``from a import b`` with
    ``a.b`` a module give ``a.b``; ``from a import name`` gives ``a``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, node.lineno, alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # a relative import starts from the module's own package, then goes up
                package = module.split(".") if is_package else module.split(".")[:-1]
                base_parts = package[: len(package) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            names_only = False
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    yield Import(submodule, node.lineno, True)
                else:
                    names_only = True
            if names_only:
                yield Import(base, node.lineno, base in modules)


def import_graph() -> tuple[Graph, list[str]]:
    """The product's import graph (module -> the product modules it imports), and the product
    imports that name no product module (a wrong resolution here, or a broken import)."""
    files = _product_files()
    graph: Graph = {name: set() for name in files}
    unresolved: list[str] = []
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for found in _imports(name, path.name == "__init__.py", tree, set(files)):
            if not _is_product(found.target):
                continue
            if found.resolved:
                graph[name].add(found.target)
            else:
                unresolved.append(f"{path.relative_to(ROOT)}:{found.line}: {found.target}")
    return graph, unresolved


def cycles(graph: Graph) -> list[list[str]]:
    """For every edge on a circle, the shortest circle through it, each once, shortest first;
    each circle as the chain of modules from its smallest name back to it."""
    found: set[tuple[str, ...]] = set()
    for source, targets in graph.items():
        for target in targets:
            path = _shortest_path(graph, target, source)
            if path is None:
                continue
            ring = path  # target ... source, then back to target
            start = ring.index(min(ring))
            found.add(tuple(ring[start:] + ring[:start]))
    chains = [[*ring, ring[0]] for ring in found]
    return sorted(chains, key=lambda chain: (len(chain), chain))


def _shortest_path(graph: Graph, start: str, goal: str) -> list[str] | None:
    came_from: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        here = queue.popleft()
        if here == goal:
            path = [here]
            while (before := came_from[path[-1]]) is not None:
                path.append(before)
            return path[::-1]
        for there in sorted(graph[here]):
            if there not in came_from:
                came_from[there] = here
                queue.append(there)
    return None


def test_every_kind_of_import_counts() -> None:
    """The resolver on a made-up module ``node.compute.x``: lazy, TYPE_CHECKING, relative and
    submodule imports all give edges, to the module named."""
    source = """
from typing import TYPE_CHECKING
import torch
from node.compute import model, NAME
from . import data
from ..daemon.loop import NodeDaemon
import protocol.codec
if TYPE_CHECKING:
    from node.compute.stream import ShardStream
def later():
    from node.errors import DataError
"""
    modules = {
        "node", "node.compute", "node.compute.model", "node.compute.data", "node.daemon",
        "node.daemon.loop", "protocol.codec", "node.compute.stream", "node.errors",
    }  # fmt: skip
    found = _imports("node.compute.x", False, ast.parse(source), modules)
    targets = {i.target for i in found if _is_product(i.target) and i.resolved}
    assert targets == modules - {"node", "node.daemon"}
    assert cycles({"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"d"}}) == [
        ["d", "d"], ["a", "b", "a"], ["a", "b", "c", "a"],
    ]  # fmt: skip


def test_every_product_import_resolves() -> None:
    graph, unresolved = import_graph()
    assert len(graph) > 100, sorted(graph)  # the walk found the product
    assert sum(map(len, graph.values())) > 300
    assert not unresolved, "\n".join(unresolved)


def test_packages_import_nothing() -> None:
    """The graph leaves out that importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``
    first; that is exact while those import nothing of the product (they are docstrings)."""
    graph, _ = import_graph()
    packages = {name for name, path in _product_files().items() if path.name == "__init__.py"}
    importing = {name: sorted(graph[name]) for name in packages if graph[name]}
    assert not importing, f"a package's __init__ imports product modules: {importing}"


def test_no_import_cycles() -> None:
    graph, _ = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(chain) for chain in found)
