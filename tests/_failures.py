"""Print every failed or erroring test of pytest's JUnit XML reports, id and message, for the end of `make test`.

Usage: python tests/_failures.py REPORT.xml [REPORT.xml ...]. Exits 1 when any report lists a
failure or an error (or is missing: that pass did not finish), 0 otherwise.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

#: Lines of a failure's message kept in the summary (the assertion and what it compared).
MESSAGE_LINES = 6


def test_id(case: ET.Element) -> str:
    """pytest's node id of a JUnit testcase: tests/unit/test_x.py::Class::test_y[param]."""
    parts = case.get("classname", "").split(".")
    # The module is the longest prefix naming a file; the rest are classes.
    for cut in range(len(parts), 0, -1):
        if Path(*parts[:cut]).with_suffix(".py").exists():
            return "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], case.get("name", "")])
    return "::".join([*parts, case.get("name", "")])


def failures(report: Path) -> list[str]:
    """One entry per failed or erroring test of `report`: its id, then its message's first lines."""
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        for kind in ("failure", "error"):
            for bad in case.findall(kind):
                text = (bad.get("message") or bad.text or "").strip().splitlines()[:MESSAGE_LINES]
                body = "\n".join("    " + line for line in text)
                out.append(f"{kind.upper()} {test_id(case)}\n{body}")
    return out


def main(argv: list[str]) -> int:
    found: list[str] = []
    for name in argv:
        path = Path(name)
        if not path.exists():
            found.append(f"MISSING {name}: that pass wrote no report (it did not finish)")
            continue
        found += failures(path)
    if found:
        print(f"\n==== {len(found)} failed test(s) ====")
        print("\n".join(found))
        return 1
    print(f"\n==== no failures in {', '.join(argv)} ====")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
