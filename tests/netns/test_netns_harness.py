"""The network-namespace harness of bench/wan.py (bench/_netns.py): hosts reach each other, tbf caps
throughput, the kernel counters see the bytes, and teardown leaves nothing behind.

Needs root and `ip netns` (skipped otherwise).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from bench import _netns
from gossamer.core.pids import pid_alive

WHY = _netns.unavailable_reason()
pytestmark = pytest.mark.timeout(60)
needs_netns = pytest.mark.skipif(WHY is not None, reason=f"network namespaces unavailable: {WHY}")

PY = sys.executable
SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    n = 0
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        n += len(b)
    c.sendall(b"k")
    c.close()
"""
CLIENT = """
import socket, sys, time
host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(100):
    try:
        s = socket.create_connection((host, port), timeout=5)
        break
    except OSError:
        time.sleep(0.05)
t = time.perf_counter()
s.sendall(b"x" * nbytes)
s.shutdown(socket.SHUT_WR)
assert s.recv(1) == b"k"
print(time.perf_counter() - t)
"""


def _transfer(net: _netns.Topology, nbytes: int, port: int = 5201) -> float:
    res = net.run(0, [PY, "-c", CLIENT, net.hosts[1].addr, str(port), str(nbytes)], timeout=40)
    assert res.returncode == 0, res.stderr
    return float(res.stdout.strip())


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {link["ifname"] for link in json.loads(out)}


@needs_netns
def test_two_hosts_shaped_counted_and_torn_down() -> None:
    links_before = _root_links()
    prefix = f"{_netns.BASE_PREFIX}{_netns.os.getpid()}-t-"
    net = _netns.Topology(2, rate="10mbit", prefix=prefix)
    with net:
        names = _netns.list_namespaces()
        assert {f"{prefix}sw", f"{prefix}h0", f"{prefix}h1"} <= set(names)
        assert "tbf" in net.qdiscs()[f"{prefix}h0/eth0"] and "tbf" in net.qdiscs()[f"{prefix}sw/h1"]
        server = net.spawn(1, [PY, "-c", SERVER, net.hosts[1].addr, "5201"])

        # TCP connect across the bridge, and tbf at 10 Mbit/s: 2 MB needs >= 1.6 s.
        before = net.counters()
        shaped = _transfer(net, 2_000_000)
        after = net.counters()
        assert shaped > 1.2, f"2 MB at 10mbit took only {shaped:.2f} s: not shaped"
        d = net.delta(before, after)
        assert d[0]["tx_bytes"] >= 2_000_000, d  # payload + headers left host 0
        assert d[1]["rx_bytes"] >= 2_000_000, d
        assert d[1]["tx_bytes"] < 500_000, d  # only ACKs back

        net.set_rate(None)  # unshaped veth: far faster
        unshaped = _transfer(net, 2_000_000)
        assert unshaped < shaped / 3, (shaped, unshaped)
        assert server.poll() is None
    # Teardown: namespaces gone (their veths and the bridge with them), processes dead,
    # nothing added to the root namespace.
    assert server.poll() is not None
    assert not [n for n in _netns.list_namespaces() if n.startswith(prefix)]
    assert net.leftovers() == []
    assert _root_links() <= links_before


@needs_netns
def test_teardown_on_exception_and_netem_probe() -> None:
    prefix = f"{_netns.BASE_PREFIX}{_netns.os.getpid()}-e-"
    net = _netns.Topology(2, rate="100mbit", delay="5ms", prefix=prefix)
    with pytest.raises(RuntimeError, match="boom"):
        with net:
            assert net.netem in (True, False)  # probed once: delay only where netem exists
            sleeper = net.spawn(0, [PY, "-c", "import time; time.sleep(60)"])
            time.sleep(0.2)
            raise RuntimeError("boom")
    assert sleeper.poll() is not None
    assert not [n for n in _netns.list_namespaces() if n.startswith(prefix)]


@needs_netns
def test_stale_namespaces_of_dead_runs_are_removed() -> None:
    dead = 2**22 + 12345  # above pid_max's default: no such process
    while pid_alive(dead):
        dead += 1
    name = f"{_netns.BASE_PREFIX}{dead}-h0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in _netns.cleanup_stale()
        assert name not in _netns.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_without_root_the_bench_says_so_and_exits_2(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(_netns.os, "geteuid", lambda: 1000)
    assert "root" in (_netns.unavailable_reason() or "")
    with pytest.raises(SystemExit) as exc:
        _netns.require_netns_or_exit("bench/wan.py")
    assert exc.value.code == 2
    assert "need root" in capsys.readouterr().err
