"""The order tests run in, and a line per file so ``pytest -q`` shows where it is.

Three tiers, run in this order (pytest's own order kept inside each):

1. **in-process**: plain functions, fakes, the daemon on its fakes; milliseconds to seconds each;
2. **on the store**: tests that use the session's SeaweedFS (the ``store`` fixture) but start
   nothing else: the coordinator's API in-process over real S3;
3. **processes**: tests whose module holds a process starter (``STARTERS``: ``subprocess``, the
   cluster and coordinator launchers, the chaos runner, ``spawn``) or that use the ``browser``.
   These are the minutes of the suite.

A test's tier is read from what its module imports and which fixtures it uses, so a new test
file lands in the right tier without being listed anywhere. The failures of the fast tiers are
seen within a few minutes, before the long multi-process runs start.

``pytest -q`` on its own prints one dot per finished test and no file name, so a file of long
tests shows nothing for minutes; with ``-q`` this plugin prints the file's name as it starts (as
pytest does without ``-q``), and a line before and after collection.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import types
from collections import Counter
from collections.abc import Generator

import pytest

from chaos.suite import chaos_test, run_scenario
from node.cluster.launch import start_coordinator, start_node
from node.cluster.process import Process
from node.research.bench.spawn import spawn as spawn_node
from node.research.wan.lab import WanLab
from support.cluster import Cluster
from support.harness import CoordinatorProcess
from support.ranks import spawn

#: Objects whose presence in a test module means its tests start processes. Not
#: ``EmbeddedStore``: most modules hold it only to annotate the session's ``store``.
STARTERS: tuple[object, ...] = (
    subprocess,
    multiprocessing,
    Process,
    start_coordinator,
    start_node,
    spawn_node,
    spawn,
    Cluster,
    CoordinatorProcess,
    chaos_test,
    run_scenario,
    WanLab,
)
#: Fixtures that start a process for the test.
PROCESS_FIXTURES = frozenset({"browser", "moto", "ministack"})
#: The fixture of the session's store.
STORE_FIXTURE = "store"

IN_PROCESS, ON_STORE, PROCESSES = 0, 1, 2
TIER_NAMES = ("in-process", "on the store", "starting processes")


def starts_processes(module: types.ModuleType) -> bool:
    """Whether ``module`` holds one of ``STARTERS`` (imported under any name)."""
    return any(obj is starter for obj in vars(module).values() for starter in STARTERS)


def tier(item: pytest.Item, module_starts: bool) -> int:
    names = set(getattr(item, "fixturenames", ()))
    if module_starts or names & PROCESS_FIXTURES:
        return PROCESSES
    if STORE_FIXTURE in names:
        return ON_STORE
    return IN_PROCESS


def order(items: list[pytest.Item]) -> list[int]:
    """The tier of each item, after sorting ``items`` in place by tier (stable)."""
    cache: dict[str, bool] = {}
    tiers: dict[int, int] = {}
    for item in items:
        module = getattr(item, "module", None)
        starts = False
        if module is not None:
            if module.__name__ not in cache:
                cache[module.__name__] = starts_processes(module)
            starts = cache[module.__name__]
        tiers[id(item)] = tier(item, starts)
    items.sort(key=lambda it: tiers[id(it)])
    return [tiers[id(it)] for it in items]


def _quiet(config: pytest.Config) -> bool:
    return config.get_verbosity() == -1


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Generator[None, object, object]:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and _quiet(session.config):
        reporter.write_line("collecting tests (imports torch and the test tools: ~20 s)")
    return (yield)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    order(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    items = session.items
    if reporter is None or not items or not _quiet(session.config):
        return
    # pytest's -q hides the file names: show each file as it starts, as pytest does without -q.
    reporter.showfspath = True
    counts = Counter(order(list(items)))
    parts = [f"{counts[t]} {TIER_NAMES[t]}" for t in (IN_PROCESS, ON_STORE, PROCESSES)]
    reporter.write_line(f"{len(items)} tests, in this order: " + ", then ".join(parts))
