"""The committed gossamer/v1 code is exactly what `make proto` generates from protos/."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    if shutil.which("protoc-gen-mypy", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mypy-protobuf is not installed")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"--mypy_out={tmp_path}", f"--mypy_grpc_out={tmp_path}", *protos],
        cwd=ROOT, env=env, check=True, capture_output=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "protoc generated nothing"
    for rel in generated:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is generated but not committed: run `make proto`"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), f"{rel} is stale: run `make proto`"
