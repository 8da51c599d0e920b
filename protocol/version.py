"""The installed package's version, shared by ``sparseloco --version`` and the coordinator's.

Read from the package metadata that ``pip install`` wrote (``pyproject.toml``'s ``version``), so
there is one number to change at a release. A source tree that was never installed says so
instead of guessing.
"""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "sparseloco"


def package_version() -> str:
    """``0.1.0``, or ``unknown (not installed)`` when no package metadata is found."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def version_line(program: str) -> str:
    """What ``--version`` prints: ``sparseloco 0.1.0``."""
    return f"{program} {package_version()}"
