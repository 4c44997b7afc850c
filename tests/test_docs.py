"""The docs hold together: README.md is the front door, the guides in docs/ link to what exists,
ARCHITECTURE.md names modules that exist, and the statements that used to go stale do not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
GUIDES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, ARCHITECTURE, *GUIDES]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def prose(path: Path) -> str:
    """The file without its code blocks (whose `#` lines are comments, not headings)."""
    return FENCE.sub("", path.read_text())


def anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces made hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", prose(path), re.MULTILINE)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(doc: Path) -> None:
    for target in LINK.findall(prose(doc)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path_part, _, fragment = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        assert path.exists(), f"{doc.name} links to {target}, which does not exist"
        if fragment and path.suffix == ".md":
            assert fragment in anchors(path), f"{doc.name} links to {target}: {path.name} has no such heading"


def test_the_readme_is_the_front_door() -> None:
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move the detail into docs/"
    first_screen = "\n".join(lines[:40])
    for tooling in ("uv", "ccache", "ninja", "mypy"):
        assert not re.search(rf"\b{tooling}\b", first_screen), f"README's first screen talks about {tooling}"
    # .ci/run runs `make test`, the command the README gives; the demo and a first job are there too.
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    for command in ("make demo", "make test", ".venv/bin/tuneq submit", "curl -s -X POST localhost:8000/jobs"):
        assert command in text, command
    for guide in GUIDES:
        assert f"](docs/{guide.name})" in text, f"README.md does not link docs/{guide.name}"


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_each_guide_opens_with_a_title_and_says_what_it_covers(guide: Path) -> None:
    lines = guide.read_text().splitlines()
    assert lines[0].startswith("# "), f"{guide.name} does not start with a title"
    opening = next(line for line in lines[1:] if line.strip() and not line.startswith("<!--"))
    assert not opening.startswith(("#", "|", "```", "-")), f"{guide.name} has no introduction under its title"


def test_stated_migration_heads_are_the_real_head() -> None:
    from alembic.script import ScriptDirectory

    from shared.db.engine import alembic_config

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    for doc in DOCS:
        text = doc.read_text()
        for stated in re.findall(r"head is (\d{4})", text):
            assert stated == head, f"{doc.name} says the head is {stated}; it is {head}"
        assert "shared:migrations" not in text, f"{doc.name}: the migrations are at shared.db:migrations"


def test_architecture_is_a_map_of_modules_that_exist() -> None:
    text = ARCHITECTURE.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows, "ARCHITECTURE.md has no package table"
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells[-1].split()) <= 45, f"ARCHITECTURE.md: a cell of {len(cells[-1].split())} words: {cells[0]}"
    for path in re.findall(r"`((?:api|cli|shared|worker|dashboard|benchmarks|tests)/[\w/]*(?:\.py)?)`", text):
        assert (ROOT / path).exists(), f"ARCHITECTURE.md names {path}, which does not exist"
    for module in (
        "api/server_processes.py",
        "worker/rank/reference_logps.py",
        "preference_loss.py",
        "api/dashboard/static/",
        "cli/api_client.py",
        "cli/commands.py",
        "cli/live.py",
        "cli/downloads.py",
    ):
        assert module in text, f"ARCHITECTURE.md does not mention {module}"
    entries = re.split(r"\n\n|\n(?=- |\d+\. )", prose(ARCHITECTURE))  # paragraphs, bullets, steps
    paragraphs = [p for p in entries if not p.lstrip().startswith("|")]
    longest = max(paragraphs, key=lambda p: len(p.split()))
    assert len(longest.split()) <= 90, f"ARCHITECTURE.md: an entry of {len(longest.split())} words:\n{longest}"
