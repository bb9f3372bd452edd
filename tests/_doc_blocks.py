"""The fenced code blocks of README.md and docs/*.md with their `<!-- run: ... -->` markers, for the tests that run them.

Markers (an HTML comment on the line before the fence; every fenced block needs one):
  `<!-- run: shell -->`            each line is a command, run in order (the quickstart's test)
  `<!-- run: file NAME -->`        the block is written to NAME in the test's directory
  `<!-- run: python nodes=N replace="OLD => NEW" ... -->`  run on a local cluster of N nodes;
                                   each OLD must occur in the block ({address}: the coordinator)
  `<!-- run: parse -->`            every `gossamer ...` command in it is accepted by the real parser
  `<!-- run: make -->`             every `make TARGET` is a target of the Makefile
  `<!-- run: skip (REASON) -->`    not run, for the reason given
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_MARKER = re.compile(r"<!--\s*run:\s*(\w+)\s*(.*?)\s*-->")
_REPLACE = re.compile(r'replace="(.*?) => (.*?)"')


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its marker's mode and arguments, and its text."""

    path: Path
    line: int  # of the opening fence, 1-based
    mode: str
    args: str
    text: str
    replacements: list[tuple[str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def commands(self) -> list[str]:
        """The block's non-empty lines without `#` comments (shell and parse modes)."""
        out = []
        for raw in self.text.splitlines():
            line = raw.split(" #")[0].strip() if not raw.lstrip().startswith("#") else ""
            if line:
                out.append(line)
        return out

    def substituted(self, **values: str) -> str:
        """The text with every `replace` of the marker applied; an OLD that is not in the block fails."""
        text = self.text
        for old, new in self.replacements:
            assert old in text, f"{self.where}: the marker replaces {old!r}, which the block no longer has"
            text = text.replace(old, new.format(**values))
        return text


def blocks(path: Path) -> list[Block]:
    """Every fenced block of `path`; a block without a marker is an AssertionError naming its line."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        start = i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        m = _MARKER.search(prev)
        assert m, f"{path.relative_to(ROOT)}:{start + 1}: a code block without a `<!-- run: ... -->` marker"
        out.append(Block(path, start + 1, m.group(1), m.group(2), "\n".join(lines[start + 1:end]) + "\n",
                         _REPLACE.findall(m.group(2))))
        i = end + 1
    return out


def gossamer_argv(command: str) -> list[str] | None:
    """The arguments after `gossamer` (or `-m gossamer.tools.cli`) in a documented command line, optional `[...]` parts
    dropped; None when the line runs no gossamer command."""
    words = shlex.split(re.sub(r"\[[^\]]*\]", "", command))
    for i, w in enumerate(words):
        if w in ("gossamer", "gossamer.tools.cli") or w.endswith("/gossamer"):
            return words[i + 1:]
    return None
