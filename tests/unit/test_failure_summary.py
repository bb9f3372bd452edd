"""`make test`'s closing summary lists each failed or erroring test by its id, with its assertion."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CASES = '''
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 + 1 == 3, "arithmetic broke"

class TestGroup:
    @pytest.mark.parametrize("n", [1])
    def test_raises(self, n):
        raise RuntimeError(f"boom {n}")

@pytest.fixture
def broken():
    raise OSError("fixture broke")

def test_errors(broken):
    pass
'''


def _summary(tmp_path: Path, *reports: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "tests" / "_failures.py"), *reports], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)


def test_summary_names_each_failure_and_its_assertion(tmp_path: Path) -> None:
    (tmp_path / "test_cases.py").write_text(CASES)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=r.xml",
                    "test_cases.py"], cwd=tmp_path, capture_output=True, timeout=120)
    out = _summary(tmp_path, "r.xml")
    assert out.returncode == 1, out.stdout
    assert "3 failed test(s)" in out.stdout, out.stdout
    assert "FAILURE test_cases.py::test_fails\n    AssertionError: arithmetic broke" in out.stdout, out.stdout
    assert "FAILURE test_cases.py::TestGroup::test_raises[1]\n    RuntimeError: boom 1" in out.stdout, out.stdout
    assert "ERROR test_cases.py::test_errors" in out.stdout and "fixture broke" in out.stdout, out.stdout
    assert "test_passes" not in out.stdout


def test_a_pass_that_wrote_no_report_fails_the_summary(tmp_path: Path) -> None:
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    pass\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=ok.xml",
                    "test_ok.py"], cwd=tmp_path, capture_output=True, timeout=120)
    assert _summary(tmp_path, "ok.xml").returncode == 0
    missing = _summary(tmp_path, "ok.xml", "quiet.xml")
    assert missing.returncode == 1 and "MISSING quiet.xml" in missing.stdout, missing.stdout
