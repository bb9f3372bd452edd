"""Emulated multi-host networks on one Linux machine: network namespaces, veth pairs, a bridge, tc.

    with Topology(4, rate="100mbit") as net:       # needs root and `ip netns`
        proc = net.spawn(0, ["python", "-m", "http.server", "--bind", net.hosts[0].addr])
        before = net.counters()
        ...
        net.set_rate("1gbit")

Layout (everything lives in namespaces this module creates; the root namespace is never touched):

    <prefix>sw     the "switch": bridge br0, one port per host (veth "h<i>")
    <prefix>h<i>   host i: veth "eth0" (address <subnet>.<i+1>/24) and lo, both up

`prefix` is ``gsm-<pid>-`` by default, so concurrent runs never collide and a stale one (its
pid dead) can be found and removed (`cleanup_stale`). Every host link is shaped with a token
bucket filter on BOTH ends of its veth pair (`tc qdisc ... root tbf rate R burst B latency L`):
the host's eth0 limits what it sends, the switch port limits what it receives. A one-way delay
is added with netem under the tbf only when the kernel has netem (`netem_available()`);
otherwise there is no added latency and `Topology.netem` says so.

Teardown (`close()`, the context manager, atexit, and SIGTERM/SIGHUP while open) kills every
process started with `spawn` (its whole process group), then any process still inside the
namespaces (all of them were started by this module's caller), then deletes the namespaces,
which removes their veths and the bridge.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gossamer.core.pids import pid_alive

BASE_PREFIX = "gsm-"
SUBNET = "10.77.0"  # host i: 10.77.0.<i+1>/24; private, and only ever inside our namespaces
HOST_IF = "eth0"
EXIT_NO_NETNS = 2

_OPEN: list[Topology] = []
_LOCK = threading.Lock()


class NetnsUnavailable(RuntimeError):
    """Root or `ip netns` / `tc` is missing: the caller cannot build namespaces here."""


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here (None when they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces, veths and tc need root (run with sudo, or as root in a privileged container)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    try:
        p = _run(["ip", "netns", "list"], check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns list` failed: {e}"
    if p.returncode != 0:
        return f"`ip netns list` failed: {p.stderr.strip()}"
    return None


def require_netns_or_exit(what: str = "this benchmark") -> None:
    """Print a clear message and exit with code 2 when namespaces are unavailable."""
    why = unavailable_reason()
    if why:
        print(f"{what} builds hosts out of Linux network namespaces and cannot run here: {why}.",
              file=sys.stderr)
        raise SystemExit(EXIT_NO_NETNS)


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(rate: str) -> float:
    """A tc rate ("100mbit", "1gbit", "10Mbit", "500kbit") in bits per second."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(bit|bps)\s*", rate.lower())
    if not m:
        raise ValueError(f"not a tc rate in bit/s or bytes/s: {rate!r}")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    return value * 8 if m.group(3) == "bps" else value


def list_namespaces() -> list[str]:
    p = _run(["ip", "-j", "netns", "list"], check=False)
    if p.returncode != 0 or not p.stdout.strip():
        return []
    return [n["name"] for n in json.loads(p.stdout)]


def cleanup_stale(base: str = BASE_PREFIX) -> list[str]:
    """Delete namespaces named `<base><pid>-...` whose creating process is gone; returns them."""
    removed = []
    pat = re.compile(rf"^{re.escape(base)}(\d+)-")
    for ns in list_namespaces():
        m = pat.match(ns)
        if m and not pid_alive(int(m.group(1))):
            _kill_ns_pids(ns)
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    return removed


def _ns_pids(ns: str) -> list[int]:
    p = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _kill_ns_pids(ns: str) -> None:
    """SIGKILL what still runs inside namespace `ns` (only processes our own run started there)."""
    for _ in range(20):
        pids = [p for p in _ns_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def netem_available(ns: str, dev: str) -> bool:
    """Try a netem qdisc on `dev` inside `ns` once (removed again); False if the kernel lacks it."""
    p = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"], check=False)
    if p.returncode != 0:
        return False
    _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    return True


@dataclass(frozen=True)
class Host:
    index: int
    ns: str
    addr: str
    ifname: str = HOST_IF
    switch_port: str = ""

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *cmd]


class Topology:
    """N hosts on one shaped bridge, each in its own network namespace (see the module doc).

    Args:
        n_hosts: number of host namespaces.
        rate: tbf rate of every host link, both directions (tc syntax: "100mbit", "1gbit"), or None.
        burst: tbf bucket size (tc syntax), or "auto": 64kb, or the bytes of 2 ms at `rate` when
            that is more (measured here: at 1gbit a 64kb bucket passes only ~735 Mbit/s, 256kb ~950).
        latency: tbf queue limit (tc syntax).
        delay: one-way delay added with netem per direction (e.g. "10ms"), only if netem exists.
        prefix: namespace name prefix (default ``gsm-<pid>-``).
    """

    def __init__(self, n_hosts: int, *, rate: str | None = None, burst: str = "auto", latency: str = "50ms",
                 delay: str | None = None, prefix: str | None = None, subnet: str = SUBNET) -> None:
        if not 1 <= n_hosts <= 200:
            raise ValueError("n_hosts must be in 1..200")
        self.n_hosts = n_hosts
        self.rate, self.burst, self.latency, self.delay = rate, burst, latency, delay
        self.prefix = prefix or f"{BASE_PREFIX}{os.getpid()}-"
        self.subnet = subnet
        self.switch = f"{self.prefix}sw"
        self.hosts = [Host(i, f"{self.prefix}h{i}", f"{subnet}.{i + 1}", HOST_IF, f"h{i}") for i in range(n_hosts)]
        self.netem: bool | None = None  # None: not probed (no delay asked for)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._created: list[str] = []
        self._old_handlers: dict[int, Any] = {}
        self.closed = False

    # --- building -----------------------------------------------------------------------
    def open(self) -> Topology:
        why = unavailable_reason()
        if why:
            raise NetnsUnavailable(why)
        with _LOCK:
            _OPEN.append(self)
        self._install_signal_handlers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _ns_add(self, ns: str) -> None:
        if ns in list_namespaces():
            raise RuntimeError(f"namespace {ns} already exists (another run with the same prefix?)")
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)

    def _create(self) -> None:
        sw = self.switch
        self._ns_add(sw)
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for h in self.hosts:
            self._ns_add(h.ns)
            # Created inside the switch namespace, the peer straight into the host's: the root
            # namespace never sees either end.
            _run(["ip", "-n", sw, "link", "add", h.switch_port, "type", "veth", "peer", "name", h.ifname,
                  "netns", h.ns])
            _run(["ip", "-n", sw, "link", "set", h.switch_port, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", h.switch_port, "up"])
            _run(["ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname])
            _run(["ip", "-n", h.ns, "link", "set", h.ifname, "up"])
            _run(["ip", "-n", h.ns, "link", "set", "lo", "up"])
        if self.delay:
            self.netem = netem_available(self.hosts[0].ns, HOST_IF)
        self.set_rate(self.rate)
        self._wait_links_up()

    def _wait_links_up(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for h in self.hosts:
            while True:
                p = _run(["ip", "-n", h.ns, "-j", "link", "show", h.ifname])
                if json.loads(p.stdout)[0].get("operstate") in ("UP", "UNKNOWN"):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{h.ns}/{h.ifname} did not come up")
                time.sleep(0.05)

    def _shape(self, ns: str, dev: str, rate: str | None) -> None:
        _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        if rate is None and not (self.delay and self.netem):
            return
        if rate is not None:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", rate,
                  "burst", self.burst_for(rate), "latency", self.latency])
        if self.delay and self.netem:
            parent = ["parent", "1:1"] if rate is not None else ["root"]
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "netem", "delay",
                  self.delay])

    def burst_for(self, rate: str) -> str:
        if self.burst != "auto":
            return self.burst
        return f"{max(64 * 1024, int(parse_rate(rate) / 8 * 0.002))}b"

    def set_rate(self, rate: str | None) -> None:
        """(Re)shape every host link, both directions, at `rate` (None: unshaped)."""
        self.rate = rate
        for h in self.hosts:
            self._shape(h.ns, h.ifname, rate)
            self._shape(self.switch, h.switch_port, rate)

    def qdiscs(self) -> dict[str, str]:
        """`tc qdisc show` of every shaped device, for the record."""
        out = {}
        for h in self.hosts:
            out[f"{h.ns}/{h.ifname}"] = _run(["tc", "-n", h.ns, "qdisc", "show", "dev", h.ifname]).stdout.strip()
            out[f"{self.switch}/{h.switch_port}"] = _run(
                ["tc", "-n", self.switch, "qdisc", "show", "dev", h.switch_port]).stdout.strip()
        return out

    # --- measuring ----------------------------------------------------------------------
    def counters(self) -> dict[int, dict[str, int]]:
        """Per host: its eth0's kernel counters (tx/rx bytes and packets, drops), read in its namespace.

        These are bytes the host put on (took off) its link: IP + TCP headers and the
        Ethernet header included (veth counts the frame without FCS/preamble); with GSO a
        super-packet is counted once with one set of headers, so header bytes are a slight
        undercount of what separate wire frames would carry.
        """
        out: dict[int, dict[str, int]] = {}
        for h in self.hosts:
            p = _run(["ip", "-n", h.ns, "-s", "-j", "link", "show", h.ifname])
            st = json.loads(p.stdout)[0]["stats64"]
            out[h.index] = {"tx_bytes": st["tx"]["bytes"], "rx_bytes": st["rx"]["bytes"],
                            "tx_packets": st["tx"]["packets"], "rx_packets": st["rx"]["packets"],
                            "tx_dropped": st["tx"]["dropped"], "rx_dropped": st["rx"]["dropped"]}
        return out

    @staticmethod
    def delta(before: dict[int, dict[str, int]], after: dict[int, dict[str, int]]) -> dict[int, dict[str, int]]:
        return {i: {k: after[i][k] - before[i][k] for k in after[i]} for i in after}

    # --- processes ----------------------------------------------------------------------
    def spawn(self, host: int, cmd: Sequence[str], *, log: str | os.PathLike[str] | None = None,
              env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.Popen[bytes]:
        """Start `cmd` inside host `host`'s namespace, in its own process group (killed at close)."""
        if self.closed:
            raise RuntimeError("topology closed")
        out: Any = subprocess.DEVNULL
        fh = open(log, "ab") if log else None  # noqa: SIM115 — handed to the child
        if fh is not None:
            out = fh
        try:
            proc = subprocess.Popen(self.hosts[host].argv(cmd), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=True)
        finally:
            if fh is not None:
                fh.close()
        self.procs.append(proc)
        return proc

    def run(self, host: int, cmd: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run `cmd` to completion inside host `host`'s namespace."""
        return _run(self.hosts[host].argv(cmd), check=False, timeout=timeout)

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        """Signal `proc`'s process group, wait, then SIGKILL the group if needed."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (spawned role processes)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        return proc.returncode

    def reap(self) -> None:
        """SIGKILL whatever still runs inside the host namespaces (between two runs of a bench)."""
        for h in self.hosts:
            _kill_ns_pids(h.ns)
        self.procs = [p for p in self.procs if p.poll() is None]

    @staticmethod
    def stop_all(procs: Sequence[subprocess.Popen[bytes]], sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Signal every process group at once, wait up to `timeout` for all, SIGKILL the rest."""
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in procs:
            Topology.stop(proc, signal.SIGKILL, timeout=2.0)

    # --- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.stop_all(self.procs, signal.SIGTERM, timeout=5.0)
            for ns in reversed(self._created):
                _kill_ns_pids(ns)
            for ns in reversed(self._created):
                _run(["ip", "netns", "del", ns], check=False)
            left = [ns for ns in list_namespaces() if ns.startswith(self.prefix)]
            for ns in left:  # retry once
                _kill_ns_pids(ns)
                _run(["ip", "netns", "del", ns], check=False)
        finally:
            with _LOCK:
                if self in _OPEN:
                    _OPEN.remove(self)
            self._restore_signal_handlers()

    def leftovers(self) -> list[str]:
        """Namespaces with this topology's prefix that still exist (empty after a clean close)."""
        return [ns for ns in list_namespaces() if ns.startswith(self.prefix)]

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            # Turn SIGTERM/SIGHUP into an exception so `finally`/`with` blocks tear down.
            raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, OSError, TypeError):
                pass
        self._old_handlers.clear()

    def __enter__(self) -> Topology:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for topo in list(_OPEN):
        try:
            topo.close()
        except Exception:  # noqa: BLE001 — best effort at interpreter exit
            pass
