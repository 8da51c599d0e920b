"""The suite's order (``support.ordering``): in-process tests first, process-starting ones last."""

from __future__ import annotations

import importlib
import subprocess
import types
from typing import Any

import pytest

from support.ordering import IN_PROCESS, ON_STORE, PROCESSES, order, starts_processes
from support.reaper import MARK


def _module(name: str, **names: object) -> types.ModuleType:
    module = types.ModuleType(name)
    vars(module).update(names)
    return module


class _Item:
    """What ``order`` reads of a collected test: its module and fixture names."""

    def __init__(self, name: str, module: types.ModuleType, *fixtures: str) -> None:
        self.name, self.module, self.fixturenames = name, module, list(fixtures)


def test_tiers_come_from_the_modules_starters_and_the_fixtures() -> None:
    plain = _module("plain", json=importlib.import_module("json"))
    spawning = _module("spawning", sp=subprocess)  # imported under another name
    items: list[Any] = [
        _Item("a", spawning),
        _Item("b", plain, "store", "tmp_path"),
        _Item("c", plain, "tmp_path"),
        _Item("d", plain, "browser"),
        _Item("e", plain),
        _Item("f", spawning, "store"),
    ]
    tiers = order(items)
    assert [it.name for it in items] == ["c", "e", "b", "a", "d", "f"]  # stable in each tier
    assert tiers == [IN_PROCESS, IN_PROCESS, ON_STORE, PROCESSES, PROCESSES, PROCESSES]


@pytest.mark.parametrize(
    ("name", "starts"),
    [
        ("test_network_run", True),
        ("test_ranks", True),
        ("test_wan_lab", True),
        ("test_codec", False),
    ],
)
def test_the_suites_modules_are_told_apart(name: str, starts: bool) -> None:
    assert starts_processes(importlib.import_module(name)) is starts


def test_this_session_marks_the_processes_it_starts() -> None:
    """Every process a test starts inherits the session's token (``support.reaper``)."""
    out = subprocess.run(
        ["sh", "-c", f'echo "${MARK}"'], capture_output=True, text=True, check=True
    )
    assert out.stdout.split(), "no session token in a child's environment"
