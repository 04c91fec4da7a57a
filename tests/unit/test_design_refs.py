"""The spec the code cites lives in the repository: every `docs/design.md §N` in code, tests, docs and
deploy files names a numbered section of docs/design.md that exists, and nothing cites the team's old
design file (`DESIGN.md`, outside the project) any more."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEARCHED = ("common", "router", "worker", "cli", "bench", "tests", "docs", "deploy", "protos")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".proto", ".toml"}
SECTION = re.compile(r"^#{2,4} §(\d+)\.", re.MULTILINE)
CITATION = re.compile(r"docs/design\.md ((?:§\d+(?:[\u2013-]§?\d+)?(?:, | and )?)+)")
NUMBER = re.compile(r"\d+")


def _files() -> list[Path]:
    found = [ROOT / "README.md"]
    for folder in SEARCHED:
        found += [p for p in (ROOT / folder).rglob("*") if p.suffix in SUFFIXES and p.is_file()]
    return sorted(found)


def _sections() -> set[int]:
    return {int(n) for n in SECTION.findall((ROOT / "docs" / "design.md").read_text())}


def test_design_md_numbers_its_sections_from_one_without_gaps() -> None:
    sections = _sections()
    assert sections, "docs/design.md has no numbered sections (## §N. Title)"
    assert sections == set(range(1, max(sections) + 1))


def test_every_citation_names_a_section_that_exists() -> None:
    sections = _sections()
    cited = 0
    missing = []
    for path in _files():
        for match in CITATION.finditer(path.read_text(errors="replace")):
            for number in NUMBER.findall(match.group(1)):
                cited += 1
                if int(number) not in sections:
                    missing.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert cited >= 20, f"only {cited} citations found: the pattern no longer matches how code cites"
    assert not missing, missing


def test_nothing_cites_the_design_file_outside_the_project() -> None:
    this = Path(__file__).resolve()
    stale = [
        str(path.relative_to(ROOT))
        for path in _files()
        if path != this and re.search(r"(?<![\w/])DESIGN\.md", path.read_text(errors="replace"))
    ]
    assert not stale, stale


def test_the_citation_pattern_catches_a_missing_section() -> None:
    """The check can fail: a citation of a section past the last one is reported."""
    text = "see docs/design.md " + "§3, §99"  # split, so this file cites nothing itself
    numbers = [int(n) for m in CITATION.finditer(text) for n in NUMBER.findall(m.group(1))]
    assert numbers == [3, 99] and 99 not in _sections()
