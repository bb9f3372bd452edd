"""Shipped code directories: a deterministic archive of the code alone, unpacked whole, private and only inside its directory."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from gossamer.core.errors import ConfigError
from gossamer.core.workdir import digest_of, pack, unpack


def _tree(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "mymod.py").write_text("def model():\n    return 1\n")
    (root / "pkg" / "__init__.py").write_text("X = 2\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    for skipped in ("__pycache__", ".git", ".venv"):
        (root / skipped).mkdir()
        (root / skipped / "junk").write_text("never shipped")
    (root / "mymod.pyc").write_bytes(b"\0")
    (root / "link.py").symlink_to(root / "mymod.py")
    return root


def _names(archive: Path) -> list[str]:
    with tarfile.open(archive, "r:gz") as tar:
        return tar.getnames()


def test_the_same_files_pack_to_the_same_digest_whatever_their_times_and_order(tmp_path: Path) -> None:
    a = pack(_tree(tmp_path / "a"))
    b_root = _tree(tmp_path / "b")
    os.utime(b_root / "mymod.py", (1, 1))
    b = pack(b_root)
    assert (a.digest, a.size, a.files) == (b.digest, b.size, 3)
    (b_root / "mymod.py").write_text("def model():\n    return 2\n")
    assert pack(b_root).digest != a.digest


def test_caches_version_control_environments_and_links_are_not_shipped(tmp_path: Path) -> None:
    packed = pack(_tree(tmp_path / "src"))
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(b"".join(packed.chunks()))
    assert _names(archive) == ["mymod.py", "pkg", "pkg/__init__.py", "run.sh"]


def test_unpack_is_owner_only_keyed_by_digest_and_reused(tmp_path: Path) -> None:
    packed = pack(_tree(tmp_path / "src"))
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(b"".join(packed.chunks()))
    out = unpack(archive, packed.digest, tmp_path / "cache")
    assert out.name == packed.digest.removeprefix("sha256:")
    assert (out / "pkg" / "__init__.py").read_text() == "X = 2\n"
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert stat.S_IMODE((out / "mymod.py").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "run.sh").stat().st_mode) == 0o700
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [out.name]  # no temporary left
    archive.unlink()
    assert unpack(archive, packed.digest, tmp_path / "cache") == out  # already there: not read again


def test_unpack_refuses_other_bytes_than_the_digest_names(tmp_path: Path) -> None:
    packed = pack(_tree(tmp_path / "src"))
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(b"".join(packed.chunks()) + b"\0")
    with pytest.raises(ValueError, match="digest"):
        unpack(archive, packed.digest, tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())


@pytest.mark.parametrize("name", ["../escape.py", "/abs.py"])
def test_unpack_refuses_an_entry_leading_outside(tmp_path: Path, name: str) -> None:
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with archive.open("rb") as f:
        digest = digest_of(f)
    with pytest.raises(ValueError, match="outside"):
        unpack(archive, digest, tmp_path / "cache")
    assert not (tmp_path / "escape.py").exists() and not any((tmp_path / "cache").iterdir())


def test_a_link_in_an_archive_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "link.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("passwd")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    with archive.open("rb") as f:
        digest = digest_of(f)
    with pytest.raises(ValueError, match="not a regular file"):
        unpack(archive, digest, tmp_path / "cache")


def test_packing_what_is_not_a_directory_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="workdir"):
        pack(tmp_path / "missing")
