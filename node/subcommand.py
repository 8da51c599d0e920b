"""A ``sparseloco`` subcommand as data: its name, help, flags and the function it runs.

Every command of the console script is one ``Command`` row (``node.cli``, ``node.tools.commands``,
``node.cluster.command``; the benchmarks are rows of their own, ``node.research.bench.cli``). A
flag is ``add_argument``'s arguments, written ``flag("--rounds", type=int)``; a command's flags are
a tuple of them, so that flags several commands share (the connection flags of ``node``,
``doctor`` and ``export``) are one tuple spliced into each. ``values`` reads flags back, by
dest, as the keywords of the config they fill. Light: no torch, nothing of the product.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: One flag: ``add_argument``'s names and keywords.
Flag = tuple[tuple[str, ...], dict[str, Any]]


def flag(*names: str, **options: Any) -> Flag:
    """A flag as data: ``flag("--nodes", type=int, default=3)``."""
    return names, options


def add_flags(p: argparse.ArgumentParser, flags: tuple[Flag, ...]) -> tuple[str, ...]:
    """Add ``flags`` to ``p``, in order; their dests."""
    return tuple(p.add_argument(*names, **options).dest for names, options in flags)


def values(args: argparse.Namespace, *dests: str) -> dict[str, Any]:
    """The flags ``dests`` as keywords of the same names."""
    return {dest: getattr(args, dest) for dest in dests}


@dataclass(frozen=True)
class Command:
    """One subcommand: ``run`` gets the parsed flags and returns the exit status."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    flags: tuple[Flag, ...] = ()
    description: str | None = None

    def add_to(self, sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
        p = sub.add_parser(self.name, help=self.help, description=self.description)
        add_flags(p, self.flags)
        p.set_defaults(func=self.run)
        return p
