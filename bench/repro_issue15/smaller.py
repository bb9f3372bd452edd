"""The "Smaller" bullet, where a stranger can check it from outside: the HTTP side's bind and the --secure material.

Issue 15: "the HTTP side binds wherever `--host` does, unauthenticated" and "removing one file of
the `--secure` material makes the next start issue a new CA and token that lock out every
worker". Here, through the CLI:
  http_bind: `coordinator serve --host 0.0.0.0 --http-port 0` (no token): PASS if the HTTP port
             listens on 127.0.0.1 only;
  secure_regen: a coordinator started with `--secure DIR`, stopped, DIR/client/token removed,
             started again: PASS if it refuses to start naming the file (the CA is not replaced).
The other items have scripts of their own: import_checks, dcp_metadata, ckpt_failures, pruning,
metric_series, final_ckpt_replace.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

from _common import LOG_ROOT, Outcome, main, wait_for

NAME = "smaller"


def _listen_addresses(port: int) -> list[str]:
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        addr, p = parts[1].split(":")
        if parts[3] == "0A" and int(p, 16) == port:
            found.append(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def http_bind(label: str) -> dict:  # type: ignore[type-arg]
    from gossamer.local_cluster import LocalCluster

    with tempfile.TemporaryDirectory(prefix="repro15-") as tmp:
        lc = LocalCluster(tmp, log_dir=LOG_ROOT / label / f"{NAME}-http",
                          coordinator_args=["--host", "0.0.0.0", "--http-port", "0"])
        try:
            lc.start_coordinator(port=0)
            port = int(wait_for(lambda: (p := Path(tmp) / "http.port").exists() and p.read_text().strip(), 30,
                                "STATE_DIR/http.port"))
            addrs = wait_for(lambda: _listen_addresses(port), 30, "the HTTP listener")
        finally:
            lc.close()
    return {"addresses": addrs, "passed": addrs == ["127.0.0.1"]}


def secure_regen(label: str) -> dict:  # type: ignore[type-arg]
    from gossamer.errors import UnavailableError
    from gossamer.local_cluster import LocalCluster

    with tempfile.TemporaryDirectory(prefix="repro15-") as tmp:
        secure = Path(tmp) / "secure"
        logs = LOG_ROOT / label / f"{NAME}-secure"
        lc = LocalCluster(Path(tmp) / "state", log_dir=logs, secure=secure)
        try:
            lc.start_coordinator(port=0)
        finally:
            lc.close()
        ca_before = (secure / "ca.crt").read_bytes()
        (secure / "client" / "token").unlink()
        lc = LocalCluster(Path(tmp) / "state", log_dir=logs, secure=secure)
        started = True
        try:
            lc.start_coordinator(port=0, timeout=60)
        except UnavailableError:
            started = False
        finally:
            with contextlib.suppress(Exception):
                lc.close()
        time.sleep(0.5)
        ca_after = (secure / "ca.crt").read_bytes() if (secure / "ca.crt").exists() else b""
        log = (logs / "coordinator.log").read_text(errors="replace").strip().splitlines()
    replaced = ca_after != ca_before
    return {"started_again": started, "ca_replaced": replaced, "log_tail": log[-2:] if log else [],
            "passed": not started and not replaced}


def run(label: str) -> Outcome:
    checks = {"http_bind": http_bind(label), "secure_regen": secure_regen(label)}
    figure = (f"http_bind: HTTP listens on {checks['http_bind']['addresses']} with --host 0.0.0.0; secure_regen: "
              f"client/token removed -> restart {'refused' if not checks['secure_regen']['started_again'] else 'ran'}"
              f", CA {'REPLACED' if checks['secure_regen']['ca_replaced'] else 'kept'}")
    return Outcome(NAME, all(c["passed"] for c in checks.values()), figure, checks)


if __name__ == "__main__":
    main(NAME, run)
