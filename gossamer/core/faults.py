"""Fault injection for tests and benchmarks, driven by the GOSSAMER_FAULT environment variable.

Syntax: comma-separated faults, each ``kind[:key=value...]``. Kinds:

- ``delay:seconds=S[:worker=I]``: worker I (default: any worker of this node) sleeps S s per step.
- ``bandwidth:rate=10mbit[:burst=B]``: cap this node's pushes with a token bucket.
- ``die:at=POINT[:step=N][:worker=I][:rank=R][:shard=S][:once=PATH][:after=PATH]``: the process SIGKILLs
  itself at POINT (``mid-push``, ``mid-pull``, ``mid-allreduce``, ``mid-checkpoint``,
  ``after-apply``, ``before-finish``: the lead past the last step, before its final
  evaluation) once the matching step/version N is reached. Used to land a kill exactly
  in the middle of an exchange. With ``after=PATH`` it fires only once PATH exists (a test
  creates it when the run has got as far as the fault must come after: driven by the run's
  progress, not raced against it). With ``once=PATH`` it fires only if PATH does not exist yet
  (and creates it), so a replacement process does not die the same way.
- ``hold:at=POINT:seconds=S[:worker=I][:rank=R]``: the thread at POINT sleeps S s (a late
  thread at an exact spot). ``final-report``: a worker past its last step, its final step
  counted, before it reports its final counters (``die:at=final-report`` kills it there).
  ``serve-exit``: a shard's serve thread that died, its link to the backup closed, before it
  ends (``shard=S`` matches). ``join``: the coordinator, on a Join it has received, before it
  registers the node (its whole event loop stalls, as an overloaded one would).
- ``gate:at=POINT:step=N:until=PATH[:seconds=MAX][:worker=I]``: the thread at POINT, once step N is
  reached, waits until PATH exists (at most MAX s, default 600), so a test holds the run where its
  fault must land and lets it go on after: the fault lands mid-run by construction, however fast
  the run. ``push``: a worker about to push once the run has made N steps (as the worker knows
  them: the shards' version, times `inner_steps` for DiLoCo).
- ``slow-start:seconds=S`` or ``slow-start:until=PATH[:seconds=MAX]``: a shard role of this node waits S s,
  or until PATH exists (at most MAX s, default 600), before it builds and serves (a slow host), so a test
  can start workers while a restored shard is not serving yet, and let it serve once they wait for it.
- ``fail:at=POINT[:step=N][:shard=S][:once=PATH]``: the thread at POINT raises `InjectedFault`
  instead (``serve-loop``: a shard's serve thread, outside any request's handling), so a test
  can check that a role whose serving thread dies fails its process.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from functools import lru_cache

__all__ = ["InjectedFault", "die_at", "fail_at", "fault", "gate_at", "hold_at", "parse_faults"]

log = logging.getLogger(__name__)


def parse_faults(spec: str | None = None) -> list[tuple[str, dict[str, str]]]:
    """[(kind, {key: value})] from `spec` (default: $GOSSAMER_FAULT)."""
    return [(kind, dict(args)) for kind, args in _parsed(os.environ.get("GOSSAMER_FAULT", "") if spec is None else spec)]


@lru_cache(maxsize=16)
def _parsed(spec: str) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """`parse_faults` of one spec string, parsed once: the hot path asks several times a step."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, *kvs = item.split(":")
        out.append((kind, tuple(dict(kv.split("=", 1) for kv in kvs if "=" in kv).items())))
    return tuple(out)


def fault(kind: str, **match: int) -> dict[str, str] | None:
    """The first fault of `kind` whose keys agree with `match` (a missing key matches anything)."""
    for k, args in parse_faults():
        if k == kind and all(key not in args or int(args[key]) == value for key, value in match.items()):
            return args
    return None


class InjectedFault(RuntimeError):
    """Raised by a ``fail:at=POINT`` fault."""


def _fires(kind: str, point: str, step: int, match: dict[str, int]) -> bool:
    spec = os.environ.get("GOSSAMER_FAULT", "")
    if not spec:  # no faults: the common case, checked at every step
        return False
    for k, args in parse_faults(spec):
        if k != kind or args.get("at") != point:
            continue
        if any(key in args and int(args[key]) != value for key, value in match.items()):
            continue
        if "after" in args and not os.path.exists(args["after"]):
            continue
        if step >= int(args.get("step", 0)):
            if "once" in args:
                try:
                    os.close(os.open(args["once"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    continue
            return True
    return False


def die_at(point: str, *, step: int, **match: int) -> None:
    """SIGKILL this process if a ``die:at=point`` fault matches and `step` reached its ``step``."""
    if _fires("die", point, step, match):
        log.warning("fault injection: dying at %s (step %d)", point, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def fail_at(point: str, *, step: int, **match: int) -> None:
    """Raise `InjectedFault` if a ``fail:at=point`` fault matches and `step` reached its ``step``."""
    if _fires("fail", point, step, match):
        log.warning("fault injection: failing at %s (step %d)", point, step)
        raise InjectedFault(f"injected fault at {point} (step {step})")


def hold_at(point: str, **match: int) -> None:
    """Sleep the ``seconds`` of the first ``hold:at=point`` fault that matches (see the module docstring)."""
    for k, args in parse_faults():
        if k == "hold" and args.get("at") == point and all(
                key not in args or int(args[key]) == value for key, value in match.items()):
            log.warning("fault injection: holding %s s at %s", args.get("seconds", "0"), point)
            time.sleep(float(args.get("seconds", "0")))
            return


def gate_at(point: str, *, step: int, **match: int) -> None:
    """Wait for the ``until`` file of a ``gate:at=point`` fault that matches once `step` reached its ``step``."""
    if not os.environ.get("GOSSAMER_FAULT"):
        return
    for k, args in parse_faults():
        if k != "gate" or args.get("at") != point or step < int(args.get("step", 0)) or any(
                key in args and int(args[key]) != value for key, value in match.items()):
            continue
        until, deadline = args["until"], time.monotonic() + float(args.get("seconds", "600"))
        if not os.path.exists(until):
            log.warning("fault injection: gated at %s (step %d) until %s exists", point, step, until)
        while not os.path.exists(until) and time.monotonic() < deadline:
            time.sleep(0.02)
        return
