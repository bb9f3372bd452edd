"""What every role process does at start: logging, threads, signals, its CURVE keyring, the agent's pipe, injected faults."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from gossamer.core.errors import ProtocolError
from gossamer.core.protocol import AssignmentUpdate, LeaseRenewal, RoleSpec, ShardStop
from gossamer.security.curve import CurveKeyPair, CurveKeyring

log = logging.getLogger(__name__)

#: Exit status of a role process that reported its own failure to the coordinator (with the
#: cause): the agent does not report it again, which the coordinator would take for a failure
#: of the role it has meanwhile put in its place on this node.
EXIT_REPORTED = 3


def setup(spec: RoleSpec) -> None:
    from gossamer.core.logs import configure
    from gossamer.node import late_imports

    late_imports.forget()  # forked from the fork server with its handler
    if spec.workdir:  # the user's shipped code before anything else, and for the role's own children too
        sys.path.insert(0, spec.workdir)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (spec.workdir, os.environ.get("PYTHONPATH"))))
    name_process(f"gossamer-{spec.label}")
    configure(spec.log_level, spec.log_format, role=spec.label, node=spec.node_name, experiment=spec.experiment_id)
    if spec.log_file:
        from gossamer.node.role_log_files import record_to_files

        try:
            record_to_files(spec.log_file, spec.log_format)
        except OSError as e:  # a full or read-only disk costs the role its log file, not its run
            log.warning("not logging to %s: %s", spec.log_file, e)
    import torch

    from gossamer.engine.allocator import mmap_large_allocations

    # Parameters, gradients and every push and reply are buffers of model size: freed ones go
    # back to the OS instead of staying in the heap of the thread that allocated them.
    mmap_large_allocations()
    # Role processes share the machine with each other: one intra-op thread each unless told.
    torch.set_num_threads(int(os.environ.get("GOSSAMER_THREADS", spec.threads)))


def name_process(name: str) -> None:
    """Name this process for `ps -o comm`, top and /proc/PID/comm (Linux; 15 bytes kept).

    A role forked from the fork server has the server's command line, so its name is what tells
    a shard from a worker rank.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def stop_on_signals() -> threading.Event:
    """An event SIGTERM or SIGINT sets: the process ends its work and exits cleanly."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop


def keyring_of(spec: RoleSpec) -> CurveKeyring | None:
    """The node's CURVE keyring for a role process (None: plaintext data plane)."""
    if not spec.curve_public or not spec.curve_secret:
        return None
    return CurveKeyring(CurveKeyPair(public=spec.curve_public, secret=spec.curve_secret),
                        server_keys=spec.assignment.curve_server_keys, members=spec.assignment.curve_members,
                        senders=spec.assignment.curve_senders)


def refresh_keyring(keyring: CurveKeyring | None, update: AssignmentUpdate) -> None:
    if keyring is not None:
        keyring.update(server_keys=update.curve_server_keys, members=update.curve_members,
                       senders=update.curve_senders)


def fault_bandwidth() -> Any:
    """GOSSAMER_FAULT=bandwidth:rate=10mbit caps this node's pushes (a token bucket)."""
    from gossamer.transport.throttle import TokenBucket, parse_bandwidth

    for fault in filter(None, os.environ.get("GOSSAMER_FAULT", "").split(",")):
        kind, *kvs = fault.split(":")
        args = dict(kv.split("=", 1) for kv in kvs if "=" in kv)
        if kind == "bandwidth" and "rate" in args:
            return TokenBucket(parse_bandwidth(args["rate"]), burst_bytes=int(args.get("burst", 16384)))
    return None


def fault_delay(worker_index: int) -> float:
    """GOSSAMER_FAULT=delay:seconds=S[:worker=I] slows worker I (any worker of this node) by S s per step."""
    spec = os.environ.get("GOSSAMER_FAULT", "")
    for fault in filter(None, spec.split(",")):
        kind, *kvs = fault.split(":")
        args = dict(kv.split("=", 1) for kv in kvs if "=" in kv)
        if kind == "delay" and int(args.get("worker", worker_index)) == worker_index:
            return float(args.get("seconds", 0.0))
    return 0.0


def drain(conn: Connection | None, on_lease: Callable[[LeaseRenewal], None] | None = None,
          on_stop: Callable[[ShardStop], None] | None = None) -> AssignmentUpdate | None:
    """The newest assignment update waiting on the agent's pipe (None if none).

    `on_lease` gets each lease renewal (a shard), and a revoked one (`until` 0) when the agent
    is gone (the pipe closed): nobody renews the lease any more. `on_stop` gets the agent's word
    that a shard stops (`ShardStop`).
    """
    latest = None
    try:
        while conn is not None and conn.poll():
            msg = conn.recv()
            if isinstance(msg, LeaseRenewal):
                if on_lease is not None:
                    on_lease(msg)
                continue
            if isinstance(msg, ShardStop):
                if on_stop is not None:
                    on_stop(msg)
                continue
            if not isinstance(msg, AssignmentUpdate):
                raise ProtocolError(f"update: expected an AssignmentUpdate, got {type(msg).__name__}")
            latest = msg
    except (EOFError, OSError):
        if on_lease is not None:
            on_lease(LeaseRenewal(until=0.0))
    return latest
