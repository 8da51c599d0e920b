"""README.md and ``docs/``: a short README that leads to every document, and no dead link.

README.md holds what the project is, the install and test commands, ``sparseloco up``, the
operator's path in short, the status and the commands' synopsis; the rest lives in ``docs/``
(the operator's guide, design notes, the WAN lab, the file map, the benchmarks). Checked here:
README's length; every ``docs/*.md`` linked from README; every relative link and image in
README, SECURITY.md and ``docs/*.md`` naming a file that exists and, with ``#anchor``, a heading
of that file; the commands of README's short operator's path being the guide's own (which
``tests/test_operator_path.py`` runs); and the file map naming only files that exist, every
file of ``docs/`` among them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 250
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", _prose(path.read_text()), flags=re.M)
    return {_slug(h) for h in headings}


def _documents() -> list[Path]:
    return [README, ROOT / "SECURITY.md", *sorted(DOCS.glob("*.md"))]


def test_the_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_every_document_is_one_click_from_the_readme() -> None:
    linked = {
        (README.parent / target.split("#")[0]).resolve()
        for target in LINK.findall(_prose(README.read_text()))
    }
    docs = sorted(DOCS.glob("*.md"))
    assert {p.name for p in docs} >= {
        "operators-guide.md",
        "design.md",
        "wan-lab.md",
        "file-map.md",
        "benchmarks.md",
    }
    missing = [p.name for p in docs if p.resolve() not in linked]
    assert not missing, f"README.md links to no {missing}"


def test_every_relative_link_and_anchor_resolves() -> None:
    dead = []
    checked = 0
    for doc in _documents():
        for target in LINK.findall(_prose(doc.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            path = (doc.parent / file_part).resolve() if file_part else doc
            checked += 1
            if not path.exists():
                dead.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and anchor not in _anchors(path):
                dead.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert checked >= 20
    assert not dead, "\n".join(dead)


def test_the_short_operators_path_is_the_guides() -> None:
    """Each command line of README's operator's path is a line of the guide, which
    ``tests/test_operator_path.py`` runs command for command: the summary cannot drift."""
    section = README.read_text().split("## Operator's path", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```bash\n(.*?)^```", section, flags=re.S | re.M)
    commands = [line for block in blocks for line in block.splitlines() if line.strip()]
    assert any(line.startswith("sparseloco node") for line in commands)
    guide = (DOCS / "operators-guide.md").read_text().splitlines()
    foreign = [line for line in commands if line not in guide]
    assert not foreign, f"not in docs/operators-guide.md: {foreign}"


def test_the_file_map_names_files_that_exist_and_every_doc() -> None:
    """A name without a folder after one with a folder is in that folder
    (``codec_bench.py``, ``codec_tables.py``)."""
    named: set[Path] = set()
    missing = []
    for line in (DOCS / "file-map.md").read_text().splitlines():
        if not line.startswith("| ") or line.startswith("| file |"):
            continue
        previous: str | None = None
        for name in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            path = name
            if "/" not in name.rstrip("/") and previous and not (ROOT / name).exists():
                path = str(Path(previous).parent / name)
            found = list(ROOT.glob(path)) if "*" in path else [ROOT / path]
            if not all(p.exists() for p in found) or not found:
                missing.append(name)
            named |= {p.resolve() for p in found}
            previous = path
    assert not missing, f"the file map names files that do not exist: {missing}"
    unlisted = [p.name for p in DOCS.iterdir() if p.resolve() not in named]
    assert not unlisted, f"docs/ files missing from the file map: {unlisted}"
