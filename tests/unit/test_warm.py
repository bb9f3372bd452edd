"""Warm role starts: a role process forked from the fork server has torch and the role code loaded already."""

from __future__ import annotations

import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from gossamer.errors import ConfigError
from gossamer.worker.warm import ROLE_MODULES, check_preload, role_context, warm_up


def _report_modules(conn: Connection) -> None:
    conn.send([m for m in ROLE_MODULES if m in sys.modules])
    conn.close()


def _loaded_at_start(warm: bool) -> list[str]:
    ctx = role_context(warm)
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_report_modules, args=(send,))
    p.start()
    send.close()
    try:
        assert recv.poll(120), "the role process did not report"
        return list(recv.recv())
    finally:
        p.join(30)
        assert p.exitcode == 0


def test_a_warm_role_starts_with_torch_and_the_role_code_imported() -> None:
    assert warm_up() >= 0.0
    assert _loaded_at_start(warm=True) == list(ROLE_MODULES)


def test_a_cold_role_imports_them_itself() -> None:
    assert "torch" not in _loaded_at_start(warm=False)


def test_preload_imports_the_users_modules_in_the_fork_server() -> None:
    # A fresh interpreter: the fork server is one per process and this one's may be running already.
    script = (
        "import sys\n"
        "from tests.unit.test_warm import _loaded_by_role\n"
        "from gossamer.worker.warm import warm_up\n"
        "warm_up(('xml.dom.minidom',))\n"
        "print(_loaded_by_role('xml.dom.minidom'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "True"


def _has_module(name: str, conn: Connection) -> None:
    conn.send(name in sys.modules)
    conn.close()


def _loaded_by_role(name: str) -> bool:
    ctx = role_context(warm=True)
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_has_module, args=(name, send))
    p.start()
    send.close()
    loaded = bool(recv.recv())
    p.join(30)
    return loaded


def test_a_module_that_is_not_there_is_refused_before_the_node_joins() -> None:
    with pytest.raises(ConfigError, match="preload.*'transfomers'"):
        check_preload(("json", "transfomers"))
    check_preload(("json", "xml.dom.minidom"))


def test_checking_a_submodule_does_not_import_its_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent only checks `transformers.models.x.y` exists; importing transformers cost it 3 s of CPU."""
    pkg = tmp_path / "heavy_pkg_for_preload"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_preload(("heavy_pkg_for_preload.sub.leaf", "heavy_pkg_for_preload.sub"))
    assert "heavy_pkg_for_preload" not in sys.modules
    with pytest.raises(ConfigError, match="preload.*'heavy_pkg_for_preload.sub.nope'"):
        check_preload(("heavy_pkg_for_preload.sub.nope",))
    for name in ("heavy_pkg_for_preload.sub", "heavy_pkg_for_preload"):
        sys.modules.pop(name, None)


def _named(conn: Connection) -> None:
    from gossamer.worker._role_process import name_process

    name_process("gossamer-w3.1")
    conn.send(open("/proc/self/comm").read().strip())
    conn.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/comm is Linux's")
def test_a_forked_role_is_named_for_ps_and_top() -> None:
    ctx = role_context(warm=True)
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_named, args=(send,))
    p.start()
    send.close()
    assert recv.recv() == "gossamer-w3.1"
    p.join(30)


def test_a_node_stopped_during_the_warm_up_leaves_no_error_in_its_log(monkeypatch: pytest.MonkeyPatch) -> None:
    # A node stopping cancels the future it awaits; the warm-up thread must not then raise on
    # setting its result ("Exception in thread gossamer-warm-up" broke a JSON log).
    import threading

    from gossamer.worker.warm import warm_up_in_background

    errors: list[object] = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    done = warm_up_in_background()
    done.cancel()
    for t in threading.enumerate():
        if t.name == "gossamer-warm-up":
            t.join(120)
    assert not errors, errors
