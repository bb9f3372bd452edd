"""Warm role starts: a role process forked from the fork server has torch and the role code loaded already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from gossamer.core import zygote
from gossamer.core.errors import ConfigError
from gossamer.node.warm import ROLE_MODULES, check_preload, role_context, warm_up


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
        "from gossamer.node.warm import warm_up\n"
        "warm_up(('xml.dom.minidom',))\n"
        "print(_loaded_by_role('xml.dom.minidom'))\n"
    )
    assert _fresh(script) == "True"


def _fresh(script: str) -> str:
    """`script`'s output in a fresh interpreter with its own fork server (one per process, not the suite's zygote)."""
    env = {k: v for k, v in os.environ.items() if k != zygote.ENV}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=True,
                         env=env)
    return out.stdout.strip()


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
    from gossamer.node._role_process import name_process

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

    from gossamer.node.warm import warm_up_in_background

    errors: list[object] = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    done = warm_up_in_background()
    done.cancel()
    for t in threading.enumerate():
        if t.name == "gossamer-warm-up":
            t.join(120)
    assert not errors, errors


def _late_state(conn: Connection) -> None:
    import signal

    from gossamer.node import late_imports

    inherited = signal.getsignal(late_imports.SIGNAL) not in (signal.SIG_DFL, signal.SIG_IGN, None)
    late_imports.forget()
    conn.send({"loaded": [m for m in late_imports.LATE_MODULES if m in sys.modules], "inherited": inherited,
               "forgot": signal.getsignal(late_imports.SIGNAL) == signal.SIG_DFL})
    conn.close()


def _late_seen() -> dict[str, object]:
    ctx = role_context(warm=True)
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_late_state, args=(send,))
    p.start()
    send.close()
    assert recv.poll(120), "the role process did not report"
    seen: dict[str, object] = recv.recv()
    p.join(30)
    assert p.exitcode == 0
    return seen


def test_the_fork_server_serves_before_its_late_imports_and_has_them_once_asked() -> None:
    """A fresh node's first role waits for torch and the role code only; dynamo and DCP come after (1.7 s + 1.2 s here)."""
    script = (
        "import json, time\n"
        "from tests.unit.test_warm import _late_seen\n"
        "from gossamer.node.late_imports import LATE_MODULES\n"
        "from gossamer.node.warm import import_late, warm_up\n"
        "warm_up(late=False)\n"
        "before = _late_seen()\n"
        "import_late()\n"
        "deadline, after = time.monotonic() + 120, {}\n"
        "while time.monotonic() < deadline:\n"
        "    after = _late_seen()\n"  # each role forked after the handler returned has them all
        "    if after['loaded'] == list(LATE_MODULES):\n"
        "        break\n"
        "print(json.dumps({'before': before, 'after': after}))\n"
    )
    seen = json.loads(_fresh(script).splitlines()[-1])
    assert seen["before"] == {"loaded": [], "inherited": True, "forgot": True}, seen
    assert seen["after"]["loaded"] == ["torch._dynamo", "gossamer.checkpoint.dcp_io"], seen


def test_role_modules_leave_the_late_ones_out() -> None:
    """What a role's first step needs imports neither dynamo nor DCP (else the second stage saves nothing)."""
    script = (
        "import sys\n"
        "from gossamer.node.warm import ROLE_MODULES\n"
        "for m in ROLE_MODULES:\n"
        "    __import__(m)\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.checkpoint') if m in sys.modules))\n"
    )
    assert _fresh(script) == "[]"
