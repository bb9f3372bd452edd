"""The `gossamer` command line's parser: every verb and flag, its default shown in --help, and "did you mean"."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

DEFAULT_COORDINATOR = "127.0.0.1:7070"
#: `gossamer coordinator ...` means `coordinator serve ...`, `gossamer worker ADDR` means `worker join ADDR`.
DEFAULT_ACTIONS = {"coordinator": "serve", "worker": "join"}


def _env(name: str, default: Any) -> Any:
    """GOSSAMER_<NAME> from the environment, else `default` (CLI flags override both)."""
    raw = os.environ.get(f"GOSSAMER_{name}")
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.lower() in ("1", "true", "yes", "on")
    if isinstance(default, (int, float)):
        return type(default)(raw)
    return raw


def env_flag(name: str, default: Any) -> Any:
    """GOSSAMER_<NAME> read as `default`'s type (for flags resolved outside the parser)."""
    return _env(name, default)


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every option's help; an unset (None/empty) default is explained by the help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default is argparse.SUPPRESS or action.nargs == 0 and default is False:
            return text  # a plain switch is off unless given
        if default is None or default == "" or default == []:
            return text
        if isinstance(default, bool):
            return f"{text} (default: {'on' if default else 'off'})"
        if isinstance(default, list):
            return f"{text} (default: {' '.join(map(str, default))})"
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose "invalid choice" and "unrecognized arguments" errors suggest the nearest name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {suggest(message, self)}\n")


def suggest(message: str, parser: argparse.ArgumentParser) -> str:
    """`message` with "; did you mean X?" when a mistyped verb or flag is close to a real one."""
    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if m:
        choices = re.findall(r"'([^']*)'", m.group(2))
        close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
        return f"{message}; did you mean '{close[0]}'?" if close else message
    m = re.search(r"unrecognized arguments: (.*)", message)
    if m:
        flags = all_flags(parser)
        hints = [f"{close[0]} (for {w})" for w in m.group(1).split() if w.startswith("--")
                 for close in [difflib.get_close_matches(w.split("=")[0], flags, n=1, cutoff=0.7)] if close]
        if hints:
            return f"{message}; did you mean {', '.join(hints)}?"
    return message


def all_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every long option string of `parser` and its subcommands."""
    out: list[str] = []
    for action in parser._actions:
        out.extend(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.extend(all_flags(sub))
    return sorted(set(out))


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Fill the default action of `coordinator` and `worker` when the command line leaves it out."""
    argv = list(argv)
    if argv and argv[0] in DEFAULT_ACTIONS:
        action = DEFAULT_ACTIONS[argv[0]]
        if len(argv) == 1 or argv[1] != action:
            argv.insert(1, action)
    return argv


# --- flags shared by several verbs -----------------------------------------------------------------
def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", "-c", default=_env("COORDINATOR", DEFAULT_COORDINATOR),
                   help="coordinator HOST:PORT, or several comma-separated (one leads: docs/ha.md) "
                        "(env GOSSAMER_COORDINATOR)")
    p.add_argument("--local", action="store_true",
                   help="use the cluster `gossamer local up` started (its address, from --local-dir)")
    p.add_argument("--local-dir", default=_env("LOCAL_DIR", default_local_dir()),
                   help="state and logs of `gossamer local up` (env GOSSAMER_LOCAL_DIR)")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to wait for the coordinator")
    _add_security_flags(p, server=False)


def default_local_dir() -> str:
    """Where `gossamer local up` keeps its state and logs unless told: one place per user."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "gossamer", "local")


def _add_security_flags(p: argparse.ArgumentParser, *, server: bool) -> None:
    """TLS / mTLS and token flags (docs/security.md); env GOSSAMER_<FLAG> for each."""
    g = p.add_argument_group("security (docs/security.md)")
    if server:
        g.add_argument("--secure", metavar="DIR", default=_env("SECURE", None),
                       help="one-flag set-up: mutual TLS + token from DIR, created (CA, certificates, token) if "
                            "missing; prints what to copy to workers (env GOSSAMER_SECURE)")
        g.add_argument("--san", action="append", default=[s for s in _env("SAN", "").split(",") if s],
                       metavar="HOST", help="with --secure: another name or IP the coordinator is reached at")
        g.add_argument("--tls-cert", default=_env("TLS_CERT", None), help="server certificate (PEM): serve TLS")
        g.add_argument("--tls-key", default=_env("TLS_KEY", None), help="server private key (PEM)")
        g.add_argument("--tls-ca", default=_env("TLS_CA", None),
                       help="CA (PEM) that signs client certificates: require them (mutual TLS)")
        g.add_argument("--token-file", default=_env("TOKEN_FILE", None),
                       help="file with the token every client must send (health checks excepted)")
        g.add_argument("--max-message-mb", type=float, default=_env("MAX_MESSAGE_MB", 16.0),
                       help="largest request accepted, MiB")
        g.add_argument("--rate-limit", type=float, default=_env("RATE_LIMIT", 200.0),
                       help="requests/s per client host (0: no limit)")
        g.add_argument("--rate-burst", type=int, default=_env("RATE_BURST", 400), help="requests at once per host")
        return
    g.add_argument("--secure", metavar="DIR", default=_env("SECURE", None),
                   help="a copy of the coordinator's secure DIR/client: CA, client certificate, token")
    g.add_argument("--tls-ca", default=_env("TLS_CA", None), help="CA (PEM) that signs the coordinator: use TLS")
    g.add_argument("--tls-cert", default=_env("TLS_CERT", None), help="client certificate (PEM) for mutual TLS")
    g.add_argument("--tls-key", default=_env("TLS_KEY", None), help="client private key (PEM) for mutual TLS")
    g.add_argument("--tls-server-name", default=_env("TLS_SERVER_NAME", None),
                   help="name to check the coordinator's certificate against (default: the host dialled)")
    g.add_argument("--token-file", default=_env("TOKEN_FILE", None), help="file with the coordinator's token")


def _add_log_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING or ERROR (env GOSSAMER_LOG_LEVEL)")
    p.add_argument("--log-format", choices=("text", "json"), default=_env("LOG_FORMAT", "text"),
                   help="text, or json: one object per line with ts, level, logger, msg, node, experiment, role"
                        " (env GOSSAMER_LOG_FORMAT)")


# --- coordinator and worker ------------------------------------------------------------------------
#: `coordinator serve` retention flags: (flag, CoordinatorConfig field, default, help).
RETENTION_FLAGS = (
    ("--metrics-retention", "metrics_retention_s", 6 * 3600.0,
     "seconds metric points are kept as reported; older ones are merged per --metrics-bucket"),
    ("--metrics-bucket", "metrics_bucket_s", 60.0, "seconds per merged point of old metrics (min/max/mean kept)"),
    ("--event-retention", "event_retention_s", 14 * 86400.0, "seconds events are kept"),
    ("--finished-retention", "finished_retention_s", 7 * 86400.0,
     "seconds a finished experiment (its record, metrics, events) is kept; checkpoint files stay"),
    ("--lost-node-retention", "lost_node_retention_s", 86400.0, "seconds a lost or departed node is listed"),
)


def _add_retention_flags(p: argparse.ArgumentParser) -> None:
    """How long the coordinator keeps state (docs/reliability.md); 0 keeps it for ever."""
    g = p.add_argument_group("retention (0: keep for ever; env GOSSAMER_<FLAG>, e.g. GOSSAMER_EVENT_RETENTION)")
    for flag, _, default, text in RETENTION_FLAGS:
        env = flag.removeprefix("--").replace("-", "_").upper()
        g.add_argument(flag, type=float, default=_env(env, default), help=text)
    g.add_argument("--import-check-concurrency", type=int, default=_env("IMPORT_CHECK_CONCURRENCY", 2),
                   help="submit-time import checks (child processes running the user's code) at once "
                        "(env GOSSAMER_IMPORT_CHECK_CONCURRENCY)")
    g.add_argument("--import-check-timeout", type=float, default=_env("IMPORT_CHECK_TIMEOUT", 120.0),
                   help="seconds one import check may run; a slower one is killed and the experiment queued "
                        "unchecked, with an event saying so (env GOSSAMER_IMPORT_CHECK_TIMEOUT)")


def _coordinator_parser(sub: Any) -> None:
    co = sub.add_parser("coordinator", help="run the coordinator (`gossamer coordinator` = `coordinator serve`)")
    cosub = co.add_subparsers(dest="action", required=True)
    s = cosub.add_parser("serve", help="serve the control plane (gRPC)")
    s.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to bind (0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=_env("PORT", 7070), help="port (0 picks a free one)")
    s.add_argument("--state-dir", default=_env("STATE_DIR", "./gossamer-state"), help="SQLite state and checkpoints")
    s.add_argument("--state", default=_env("STATE", ""),
                   help="where the state lives: sqlite (default, in --state-dir) or postgresql://USER@HOST:PORT/DB; "
                        "with PostgreSQL several coordinators may serve and one leads (docs/ha.md) (env GOSSAMER_STATE)")
    s.add_argument("--advertise", default=_env("ADVERTISE", ""),
                   help="HOST:PORT the standbys name when this coordinator leads (default: --host and the port)")
    s.add_argument("--heartbeat-interval", type=float, default=_env("HEARTBEAT_INTERVAL", 1.0),
                   help="seconds between a node's heartbeats")
    s.add_argument("--lease-timeout", type=float, default=_env("LEASE_TIMEOUT", 10.0),
                   help="seconds without heartbeat before a node is declared lost")
    s.add_argument("--udp-beats", action=argparse.BooleanOptionalAction, default=_env("UDP_BEATS", True),
                   help="nodes heartbeat with one authenticated UDP datagram, falling back to gRPC when it goes "
                        "unanswered; --no-udp-beats: gRPC only (docs/scale.md) (env GOSSAMER_UDP_BEATS)")
    s.add_argument("--beat-port", type=int, default=_env("BEAT_PORT", None),
                   help="UDP port of those heartbeats on --host (0 picks a free one; default: --port's number, or "
                        "a free one if that is taken) (env GOSSAMER_BEAT_PORT)")
    s.add_argument("--final-report-timeout", type=float, default=_env("FINAL_REPORT_TIMEOUT", 30.0),
                   help="seconds a run waits, after the lead's Complete, for the other workers' final counters "
                        "before it completes saying whose are missing")
    s.add_argument("--ready-file", default=None, help="write the bound port here once serving")
    s.add_argument("--no-import-check", action="store_true", help="skip importing model/dataset at submit")
    s.add_argument("--http-port", type=int, default=_env("HTTP_PORT", None),
                   help="serve the status page and Prometheus /metrics on this port (0 picks a free one, written to "
                        "STATE_DIR/http.port); off unless given (env GOSSAMER_HTTP_PORT)")
    s.add_argument("--http-host", default=_env("HTTP_HOST", "127.0.0.1"),
                   help="address the HTTP side binds, whatever --host is; with a token it asks for it "
                        "(docs/security.md) (env GOSSAMER_HTTP_HOST)")
    _add_retention_flags(s)
    _add_security_flags(s, server=True)
    s.add_argument("--curve", action=argparse.BooleanOptionalAction, default=None,
                   help="CurveZMQ on the data plane: shards and gossip peers accept only the experiment's members' "
                        "keys (env GOSSAMER_CURVE; default: on when serving TLS)")
    _add_log_flags(s)
    s.set_defaults(fn="coordinator_serve")


def _worker_parser(sub: Any) -> None:
    wo = sub.add_parser("worker", help="run a node agent (`gossamer worker ADDR` = `worker join ADDR`)")
    wosub = wo.add_subparsers(dest="action", required=True)
    j = wosub.add_parser("join", help="join a coordinator and run the roles it assigns")
    j.add_argument("coordinator", nargs="?", default=_env("COORDINATOR", DEFAULT_COORDINATOR),
                   help="HOST:PORT, or every coordinator's, comma-separated: the node follows the leader "
                        "(docs/ha.md) (env GOSSAMER_COORDINATOR)")
    j.add_argument("--coordinator", "-c", dest="coordinator_flag", default=None,
                   help="the same as the positional HOST:PORT[,HOST:PORT...] (it wins when both are given)")
    j.add_argument("--name", default=_env("NAME", ""), help="node name (default hostname-id)")
    j.add_argument("--address", default=_env("ADDRESS", ""),
                   help="address other nodes use to reach this one (default: the one that routes to the coordinator)")
    j.add_argument("--nproc-per-node", type=int, default=_env("NPROC_PER_NODE", None),
                   help="local ranks per worker (default 1; under torchrun/srun: its processes on this node)")
    j.add_argument("--spot", action="store_true", default=_env("SPOT", False), help="preemptible machine")
    j.add_argument("--labels", nargs="*", default=[], metavar="K=V", help="labels of this node")
    j.add_argument("--grace", type=float, default=_env("GRACE", 30.0),
                   help="seconds to leave gracefully on SIGTERM (a spot notice): finish the step, hand shards over")
    j.add_argument("--join-timeout", type=float, default=_env("JOIN_TIMEOUT", 0.0),
                   help="seconds to keep trying to reach the coordinator before giving up with exit code 2 "
                        "(0: keep trying)")
    j.add_argument("--threads", type=int, default=_env("THREADS", 1), help="torch threads per role process")
    j.add_argument("--checkpoint-dir", default=_env("CHECKPOINT_DIR", ""),
                   help="where this node's roles write checkpoints, in place of the experiment's checkpoint_dir "
                        "(a disk local to this node; a shard restored elsewhere fetches its files from here) "
                        "(env GOSSAMER_CHECKPOINT_DIR)")
    j.add_argument("--run-dir", default=_env("RUN_DIR", ""),
                   help="under torchrun/srun: private directory of the socket where local ranks attach to local "
                        "rank 0's agent (default $TMPDIR/gossamer-UID; env GOSSAMER_RUN_DIR)")
    j.add_argument("--attach-timeout", type=float, default=_env("ATTACH_TIMEOUT", 120.0),
                   help="under torchrun/srun: seconds local ranks wait for each other before giving up")
    j.add_argument("--warm-roles", action=argparse.BooleanOptionalAction, default=_env("WARM_ROLES", True),
                   help="start role processes from a fork server that imports torch while the node waits, so a "
                        "role starts in milliseconds (env GOSSAMER_WARM_ROLES)")
    j.add_argument("--preload", nargs="*", metavar="MODULE", default=[m for m in _env("PRELOAD", "").split(",") if m],
                   help="modules the fork server imports once for every role, e.g. transformers or your model's "
                        "module (env GOSSAMER_PRELOAD, comma-separated; default none)")
    j.add_argument("--metrics-port", type=int, default=_env("METRICS_PORT", None),
                   help="serve this node's Prometheus /metrics on this port (0 picks a free one, logged); off unless "
                        "given (env GOSSAMER_METRICS_PORT)")
    j.add_argument("--metrics-host", default=_env("METRICS_HOST", ""),
                   help="address /metrics binds (default: --address, the one other nodes reach this node at)")
    _add_security_flags(j, server=False)
    _add_log_flags(j)
    j.set_defaults(fn="worker_join")


def _local_parser(sub: Any) -> None:
    lo = sub.add_parser("local", help="a whole cluster on this machine, in the background (up, down, status)")
    losub = lo.add_subparsers(dest="action", required=True)
    up = losub.add_parser("up", help="start a coordinator and node agents here; print the address")
    up.add_argument("--nodes", type=int, default=5, help="node agents to start (enough for examples/digits.toml)")
    up.add_argument("--spot", type=int, default=3, help="how many of them are spot (the rest on-demand: shards)")
    up.add_argument("--gpus-per-node", type=int, default=0,
                    help="GPUs each node gets (CUDA_VISIBLE_DEVICES slices, one local rank each; 0: CPU, one rank)")
    up.add_argument("--http-port", type=int, default=0, help="status page port (0 picks a free one)")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for every node to join")
    up.add_argument("--dir", default=_env("LOCAL_DIR", default_local_dir()),
                    help="state and logs of this cluster (env GOSSAMER_LOCAL_DIR)")
    up.set_defaults(fn="local_up")
    down = losub.add_parser("down", help="stop every process `local up` started (logs stay)")
    down.add_argument("--dir", default=_env("LOCAL_DIR", default_local_dir()),
                      help="the directory given to `local up` (env GOSSAMER_LOCAL_DIR)")
    down.add_argument("--grace", type=float, default=15.0, help="seconds the nodes get to leave before SIGKILL")
    down.set_defaults(fn="local_down")
    info = losub.add_parser("status", help="whether a local cluster is up, its address and status page")
    info.add_argument("--dir", default=_env("LOCAL_DIR", default_local_dir()),
                      help="the directory given to `local up` (env GOSSAMER_LOCAL_DIR)")
    info.set_defaults(fn="local_status")


# --- client verbs ----------------------------------------------------------------------------------
def _client_parsers(sub: Any) -> None:
    s = sub.add_parser("submit", help="submit an experiment file (TOML)")
    s.add_argument("file", help="the experiment file (TOML; see examples/)")
    s.add_argument("--wait", action="store_true", help="follow progress until it finishes")
    s.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    s.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a field")
    _add_client_flags(s)
    s.set_defaults(fn="submit")

    st = sub.add_parser("status", help="experiments and nodes, or one experiment")
    st.add_argument("id", nargs="?", help="an experiment id (default: every experiment and node)")
    st.add_argument("--json", action="store_true", help="print JSON")
    _add_client_flags(st)
    st.set_defaults(fn="status")

    n = sub.add_parser("nodes", help="list nodes")
    n.add_argument("--json", action="store_true", help="print JSON")
    _add_client_flags(n)
    n.set_defaults(fn="nodes")

    w = sub.add_parser("watch", help="a live table of an experiment until it finishes (Ctrl-C detaches)")
    w.add_argument("id", help="the experiment id")
    w.add_argument("--quiet", "-q", action="store_true", help="no live table: wait, then print the outcome")
    w.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    _add_client_flags(w)
    w.set_defaults(fn="watch")

    c = sub.add_parser("cancel", help="cancel an experiment")
    c.add_argument("id", help="the experiment id")
    _add_client_flags(c)
    c.set_defaults(fn="cancel")

    ev = sub.add_parser("events", help="the event log of an experiment (failures, recoveries, discards)")
    ev.add_argument("id", help="the experiment id")
    ev.add_argument("--json", action="store_true", help="print JSON")
    _add_client_flags(ev)
    ev.set_defaults(fn="events")

    pl = sub.add_parser("plot", help="loss, accuracy, throughput and bytes against time, as a PNG")
    pl.add_argument("id", help="the experiment id")
    pl.add_argument("--out", "-o", default=None, help="output file (default ID.png; .svg/.pdf by suffix)")
    _add_client_flags(pl)
    pl.set_defaults(fn="plot")

    ex = sub.add_parser("export", help="an experiment's metric series as TensorBoard event files")
    ex.add_argument("id", help="the experiment id")
    ex.add_argument("--tensorboard", required=True, metavar="DIR",
                    help="write DIR/ID/<node>[/<rank>]/events.out.tfevents.*: one run per worker rank and shard")
    _add_client_flags(ex)
    ex.set_defaults(fn="export")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; `args.fn` names the command's handler in gossamer.cli."""
    p = Parser(prog="gossamer", description="Decentralized, asynchronous, elastic training.")
    sub = p.add_subparsers(dest="command", required=True)
    _coordinator_parser(sub)
    _worker_parser(sub)
    _client_parsers(sub)
    _local_parser(sub)

    se = sub.add_parser("security", help="secure set-up (docs/security.md)")
    sesub = se.add_subparsers(dest="action", required=True)
    si = sesub.add_parser("init", help="create a CA, coordinator and client certificates and a token in DIR")
    si.add_argument("dir", help="where to write them")
    si.add_argument("--san", action="append", default=[], metavar="HOST",
                    help="a name or IP the coordinator is reached at (repeatable; this machine's are included)")
    si.add_argument("--address", default="HOST:7070", help="coordinator address to show in the instructions")
    si.set_defaults(fn="security_init")

    d = sub.add_parser("demo", help="a whole local cluster: coordinator, shards, workers, digits in async mode")
    d.add_argument("--workers", type=int, default=3, help="spot nodes, one worker each")
    d.add_argument("--shards", type=int, default=2, help="on-demand nodes, one shard each")
    d.add_argument("--steps", type=int, default=1500, help="total_steps")
    d.add_argument("--keep", action="store_true", help="keep the demo's state directory")
    d.set_defaults(fn="demo")
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """`argv` parsed after `normalize_argv` (the default actions of `coordinator` and `worker`)."""
    return build_parser().parse_args(normalize_argv(argv))
