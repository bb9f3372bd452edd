"""The README stays a front page, and every relative link of the README and docs/ leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

from gossamer.core.experiment import Experiment
from tests._doc_blocks import ROOT, blocks

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 400

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The page without its code: a link-like string inside a code block or span is not a link."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def _anchors(path: Path) -> set[str]:
    """The fragments GitHub gives the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    out: set[str] = set()
    for title in _HEADING.findall(_FENCE.sub("", path.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
        n = 1
        unique = slug
        while unique in out:  # GitHub numbers repeated headings
            unique = f"{slug}-{n}"
            n += 1
        out.add(unique)
    return out


def _relative_links(path: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(path.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_readme_is_a_front_page_of_at_most_400_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {MAX_README_LINES})"


def test_every_relative_link_of_the_readme_and_docs_points_to_an_existing_file_and_heading() -> None:
    checked = 0
    for page in PAGES:
        for target in _relative_links(page):
            where, _, fragment = target.partition("#")
            dest = (page.parent / where).resolve() if where else page
            assert dest.exists(), f"{page.relative_to(ROOT)}: link to {target!r}: {where} does not exist"
            if fragment and dest.suffix == ".md":
                assert fragment in _anchors(dest), (
                    f"{page.relative_to(ROOT)}: link to {target!r}: {dest.relative_to(ROOT)} has no heading #{fragment}")
            checked += 1
    assert checked >= 50, checked  # the README alone links every docs page


def test_the_readme_links_every_docs_page() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _relative_links(README)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_every_figure_file_the_docs_cite_exists() -> None:
    """A figure is cited as bench/results/NAME.md in prose as well as in links: each such file is there."""
    for page in PAGES:
        for name in re.findall(r"bench/results/([\w-]+\.(?:md|json|png))", page.read_text()):
            assert (ROOT / "bench" / "results" / name).exists(), f"{page.relative_to(ROOT)} cites bench/results/{name}"


def test_the_readme_experiment_file_is_examples_digits_toml(tmp_path: Path) -> None:
    (block,) = [b for b in blocks(README) if b.text.lstrip().startswith("name = ")]
    shown = tmp_path / "shown.toml"
    shown.write_text(block.text)
    assert Experiment.from_toml(shown).to_dict() == Experiment.from_toml(ROOT / "examples" / "digits.toml").to_dict()
