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


#: Exit codes of every command (`gossamer --help` and README "Exit codes").
EXIT_OK = 0  # done; for a run followed to its end: it completed
EXIT_FAILED = 1  # the command or the run failed (an unknown id, a run that failed or was cancelled)
EXIT_USAGE = 2  # a usage error: a bad flag or value (argparse), a bad configuration or credentials
#: The coordinator did not answer or refused the connection (a local rank: its node agent), or, from
#: `coordinator serve`, it lost its lead: the same command may work when run again.
EXIT_UNREACHABLE = 3

EPILOG = f"""exit codes:
  {EXIT_OK}    done (a followed run completed)
  {EXIT_FAILED}    the command or the run failed (unknown id, the run failed or was cancelled)
  {EXIT_USAGE}    usage error: a bad flag or value, a bad configuration (an experiment field, an
       address without :PORT), missing or refused credentials
  {EXIT_UNREACHABLE}    the coordinator did not answer or refused the connection (from `coordinator
       serve`: it lost its lead); the same command may work when run again
  130  interrupted (Ctrl-C)

environment: every flag --NAME-X can come from GOSSAMER_NAME_X (each command's --help names
its variable); a flag beats its variable, which beats the default. --set FIELD=VALUE's is
GOSSAMER_EXP_FIELD=VALUE."""


def _boolean(raw: str) -> bool:
    """A switch's value from the environment: 1/true/yes/on or 0/false/no/off (any case)."""
    if raw.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if raw.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"invalid switch value: {raw!r} (1/true/yes/on or 0/false/no/off)")


def env_var(names: Sequence[str], dest: str = "") -> str:
    """The variable of an option: GOSSAMER_ and its long flag (else its name) upper-cased, "-" as "_"."""
    flag = next((n for n in names if n.startswith("--")), names[0] if names else dest)
    return "GOSSAMER_" + flag.removeprefix("--").replace("-", "_").upper()


def _add(p: Any, *names: str, env: str = "", **kw: Any) -> argparse.Action:
    """`p.add_argument(*names, **kw)` whose default comes from its variable when that is set.

    The variable is `env_var(names)` unless `env` names it (GOSSAMER_<env>): where one flag
    name means different things in two verbs. It is kept on the action (`action.env`) for
    --help. A switch reads 1/true/yes/on or 0/false/no/off, a list comma-separated values; a
    value the flag's type refuses is kept as the variable's text, so argparse refuses it when
    (and only when) this verb is parsed, naming the flag.
    """
    if kw.get("action") == "append":
        kw["action"] = _AppendOverDefault
    action = p.add_argument(*names, **kw)
    var = f"GOSSAMER_{env}" if env else env_var(names, action.dest)
    action.env = var  # type: ignore[attr-defined]
    if action.choices is not None and action.type is None:
        action.type = _one_of(tuple(action.choices))
    raw = os.environ.get(var)
    if raw is not None:
        action.default = _from_env(action, raw)
        action.required = False
    return action


def _verbs(sub: Any, name: str, help: str) -> Any:
    """The actions of `gossamer NAME ACTION ...`: add each with `.add_parser` (the action is `args.action`)."""
    return sub.add_parser(name, help=help).add_subparsers(dest="action", required=True)


class _AppendOverDefault(argparse._AppendAction):
    """A repeatable flag whose values replace its default (its variable's list) instead of adding to it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        items = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*([] if items is self.default else items or []), values])


def _one_of(choices: tuple[Any, ...]) -> Any:
    def choice(raw: str) -> str:
        if raw not in choices:
            raise argparse.ArgumentTypeError(f"invalid choice: {raw!r} (choose from {', '.join(map(str, choices))})")
        return raw
    return choice


def _from_env(action: argparse.Action, raw: str) -> Any:
    """The default `raw` (the variable's text) gives `action`: converted, or the text itself if it is bad."""
    if action.nargs == 0:  # a switch
        action.type = _boolean  # argparse converts a text default with it: a bad one fails at parse time
    if action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction):
        return [part.strip() for part in raw.split(",") if part.strip()]
    convert: Any = action.type if callable(action.type) else str
    try:
        return convert(raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return raw


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" and "(env GOSSAMER_X)" to every option's help (an unset default is explained by the
    help); the epilog keeps its lines."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = self._default_help(action)
        var = getattr(action, "env", None)
        return f"{text} (env {var})" if var and var not in text else text

    def _default_help(self, action: argparse.Action) -> str:
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
        self.exit(EXIT_USAGE, f"{self.prog}: error: {suggest(message, self)}{_env_source(message, self)}\n")


def _env_source(message: str, parser: argparse.ArgumentParser) -> str:
    """" (from GOSSAMER_X)" when the value `message` refuses is that of a variable set in the environment."""
    for action in parser._actions:
        var = getattr(action, "env", "")
        raw = os.environ.get(var) if var else None
        if raw is not None and message.startswith(f"argument {argparse._get_action_name(action)}:") \
                and repr(raw) in message:
            return f" (from {var})"
    return ""


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


def env_names(parser: argparse.ArgumentParser) -> set[str]:
    """Every GOSSAMER_* variable an option of `parser` or its subcommands reads."""
    out = {var for action in parser._actions if (var := getattr(action, "env", ""))}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= env_names(sub)
    return out


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
    _add(p, "--coordinator", "-c", default=DEFAULT_COORDINATOR,
            help="coordinator HOST:PORT, or several comma-separated (one leads: docs/ha.md) "
                 "(env GOSSAMER_COORDINATOR)")
    _add(p, "--local", action="store_true",
            help="use the cluster `gossamer local up` started (its address, from --local-dir)")
    _add(p, "--local-dir", default=default_local_dir(),
            help="state and logs of `gossamer local up` (env GOSSAMER_LOCAL_DIR)")
    _add(p, "--connect-timeout", type=float, default=5.0, help="seconds to wait for the coordinator")
    _add_security_flags(p, server=False)


def default_local_dir() -> str:
    """Where `gossamer local up` keeps its state and logs unless told: one place per user."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "gossamer", "local")


def _add_security_flags(p: argparse.ArgumentParser, *, server: bool) -> None:
    """TLS / mTLS and token flags (docs/security.md); env GOSSAMER_<FLAG> for each."""
    g = p.add_argument_group("security (docs/security.md)")
    if server:
        _add(g, "--secure", metavar="DIR", default=None,
                help="one-flag set-up: mutual TLS + token from DIR, created (CA, certificates, token) if "
                     "missing; prints what to copy to workers (env GOSSAMER_SECURE)")
        _add(g, "--san", action="append", default=[],
                metavar="HOST", help="with --secure: another name or IP the coordinator is reached at")
        _add(g, "--tls-cert", default=None, help="server certificate (PEM): serve TLS")
        _add(g, "--tls-key", default=None, help="server private key (PEM)")
        _add(g, "--tls-ca", default=None,
                help="CA (PEM) that signs client certificates: require them (mutual TLS)")
        _add(g, "--token-file", default=None,
                help="file with the token every client must send (health checks excepted)")
        _add(g, "--viewer-token-file", default=None,
                help="file with the read-only token of the status page, /api and /metrics (never accepted for "
                     "joining or submitting); default: derived from the join token, written to "
                     "STATE_DIR/viewer.token")
        _add(g, "--max-message-mb", type=float, default=16.0,
                help="largest request accepted, MiB")
        _add(g, "--rate-limit", type=float, default=200.0,
                help="requests/s per client host (0: no limit)")
        _add(g, "--rate-burst", type=int, default=400, help="requests at once per host")
        return
    _add(g, "--secure", metavar="DIR", default=None,
            help="a copy of the coordinator's secure DIR/client: CA, client certificate, token")
    _add(g, "--tls-ca", default=None, help="CA (PEM) that signs the coordinator: use TLS")
    _add(g, "--tls-cert", default=None, help="client certificate (PEM) for mutual TLS")
    _add(g, "--tls-key", default=None, help="client private key (PEM) for mutual TLS")
    _add(g, "--tls-server-name", default=None,
            help="name to check the coordinator's certificate against (default: the host dialled)")
    _add(g, "--token-file", default=None, help="file with the coordinator's token")


def _add_log_flags(p: argparse.ArgumentParser) -> None:
    _add(p, "--log-level", default="INFO",
            help="DEBUG, INFO, WARNING or ERROR (env GOSSAMER_LOG_LEVEL)")
    _add(p, "--log-format", choices=("text", "json"), default="text",
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
    g = p.add_argument_group("retention (0: keep for ever)")
    for flag, _, default, text in RETENTION_FLAGS:
        _add(g, flag, type=float, default=default, help=text)
    _add(g, "--import-check-concurrency", type=int, default=2,
            help="submit-time import checks (child processes running the user's code) at once "
                 "(env GOSSAMER_IMPORT_CHECK_CONCURRENCY)")
    _add(g, "--import-check-timeout", type=float, default=120.0,
            help="seconds one import check may run; a slower one is killed and the experiment queued "
                 "unchecked, with an event saying so (env GOSSAMER_IMPORT_CHECK_TIMEOUT)")
    _add(g, "--workdir-max-mib", type=float, default=64.0,
            help="largest packed code directory `submit --workdir` may ship; a bigger one is refused naming "
                 "its size (env GOSSAMER_WORKDIR_MAX_MIB)")
    _add(g, "--workdir-store-mib", type=float, default=1024.0,
            help="all stored code directories together at most; those no active experiment names are "
                 "dropped first (env GOSSAMER_WORKDIR_STORE_MIB)")


def _coordinator_parser(sub: Any) -> None:
    cosub = _verbs(sub, "coordinator", "run the coordinator (`gossamer coordinator` = `coordinator serve`)")
    s = cosub.add_parser("serve", help="serve the control plane (gRPC)")
    _add(s, "--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    _add(s, "--port", type=int, default=7070, help="port (0 picks a free one)")
    _add(s, "--state-dir", default="./gossamer-state", help="SQLite state and checkpoints")
    _add(s, "--state", default="",
            help="where the state lives: sqlite (default, in --state-dir) or postgresql://USER@HOST:PORT/DB; "
                 "with PostgreSQL several coordinators may serve and one leads (docs/ha.md) (env GOSSAMER_STATE)")
    _add(s, "--advertise", default="",
            help="HOST:PORT the standbys name when this coordinator leads (default: --host and the port)")
    _add(s, "--heartbeat-interval", type=float, default=1.0,
            help="seconds between a node's heartbeats")
    _add(s, "--lease-timeout", type=float, default=10.0,
            help="seconds without heartbeat before a node is declared lost")
    _add(s, "--udp-beats", action=argparse.BooleanOptionalAction, default=True,
            help="nodes heartbeat with one authenticated UDP datagram, falling back to gRPC when it goes "
                 "unanswered; --no-udp-beats: gRPC only (docs/scale.md) (env GOSSAMER_UDP_BEATS)")
    _add(s, "--beat-port", type=int, default=None,
            help="UDP port of those heartbeats on --host (0 picks a free one; default: --port's number, or "
                 "a free one if that is taken) (env GOSSAMER_BEAT_PORT)")
    _add(s, "--final-report-timeout", type=float, default=30.0,
            help="seconds a run waits, after the lead's Complete, for the other workers' final counters "
                 "before it completes saying whose are missing")
    _add(s, "--ready-file", default=None, help="write the bound port here once serving")
    _add(s, "--no-import-check", action="store_true", help="skip importing model/dataset at submit")
    _add(s, "--http-port", type=int, default=None,
            help="serve the status page and Prometheus /metrics on this port (0 picks a free one, written to "
                 "STATE_DIR/http.port); off unless given (env GOSSAMER_HTTP_PORT)")
    _add(s, "--http-host", default="127.0.0.1",
            help="address the HTTP side binds, whatever --host is; with a token it asks for it "
                 "(docs/security.md) (env GOSSAMER_HTTP_HOST)")
    _add_retention_flags(s)
    _add_security_flags(s, server=True)
    _add(s, "--curve", action=argparse.BooleanOptionalAction, default=None,
            help="CurveZMQ on the data plane: shards and gossip peers accept only the experiment's members' "
                 "keys (env GOSSAMER_CURVE; default: on when serving TLS)")
    _add_log_flags(s)
    s.set_defaults(fn="coordinator_serve")


def _worker_parser(sub: Any) -> None:
    wosub = _verbs(sub, "worker", "run a node agent (`gossamer worker ADDR` = `worker join ADDR`)")
    j = wosub.add_parser("join", help="join a coordinator and run the roles it assigns")
    _add(j, "coordinator", nargs="?", default=DEFAULT_COORDINATOR,
            help="HOST:PORT, or every coordinator's, comma-separated: the node follows the leader "
                 "(docs/ha.md) (env GOSSAMER_COORDINATOR)")
    j.add_argument("--coordinator", "-c", dest="coordinator_flag", default=None,
                   help="the same as the positional HOST:PORT[,HOST:PORT...] (it wins when both are given)")
    _add(j, "--name", default="", help="node name (default hostname-id)")
    _add(j, "--address", default="",
            help="address other nodes use to reach this one (default: the one that routes to the coordinator)")
    _add(j, "--nproc-per-node", type=int, default=None,
            help="local ranks per worker (default 1; under torchrun/srun: its processes on this node)")
    _add(j, "--spot", action="store_true", default=False, help="preemptible machine")
    _add(j, "--labels", nargs="*", default=[], metavar="K=V", help="labels of this node")
    _add(j, "--grace", type=float, default=30.0,
            help="seconds to leave gracefully on SIGTERM (a spot notice): finish the step, hand shards over")
    _add(j, "--join-timeout", type=float, default=0.0,
            help="seconds to keep trying to reach the coordinator before giving up with exit code 3 "
                 "(0: keep trying)")
    _add(j, "--threads", type=int, default=1, help="torch threads per role process")
    _add(j, "--log-dir", default="",
         help="where role processes' logs and last tracebacks go (DIR/<node id>/<experiment>/), served to "
              "`gossamer logs` through the coordinator (default: <run dir>/logs)")
    _add(j, "--checkpoint-dir", default="",
            help="where this node's roles write checkpoints, in place of the experiment's checkpoint_dir "
                 "(a disk local to this node; a shard restored elsewhere fetches its files from here) "
                 "(env GOSSAMER_CHECKPOINT_DIR)")
    _add(j, "--run-dir", default="",
            help="under torchrun/srun: private directory of the socket where local ranks attach to local "
                 "rank 0's agent (default $TMPDIR/gossamer-UID; env GOSSAMER_RUN_DIR)")
    _add(j, "--attach-timeout", type=float, default=120.0,
            help="under torchrun/srun: seconds local ranks wait for each other before giving up")
    _add(j, "--warm-roles", action=argparse.BooleanOptionalAction, default=True,
            help="start role processes from a fork server that imports torch while the node waits, so a "
                 "role starts in milliseconds (env GOSSAMER_WARM_ROLES)")
    _add(j, "--preload", nargs="*", metavar="MODULE", default=[],
            help="modules the fork server imports once for every role, e.g. transformers or your model's "
                 "module (env GOSSAMER_PRELOAD, comma-separated; default none)")
    _add(j, "--metrics-port", type=int, default=None,
            help="serve this node's Prometheus /metrics on this port (0 picks a free one, logged); off unless "
                 "given (env GOSSAMER_METRICS_PORT)")
    _add(j, "--metrics-host", default="",
            help="address /metrics binds (default: --address, the one other nodes reach this node at)")
    _add_security_flags(j, server=False)
    _add_log_flags(j)
    j.set_defaults(fn="worker_join")


def _local_parser(sub: Any) -> None:
    losub = _verbs(sub, "local", "a whole cluster on this machine, in the background (up, down, status)")
    up = losub.add_parser("up", help="start a coordinator and node agents here; print the address")
    _add(up, "--nodes", type=int, default=5, help="node agents to start (enough for examples/digits.toml)")
    _add(up, "--spot", env="LOCAL_SPOT", type=int, default=3, help="how many of them are spot (the rest on-demand: shards)")
    _add(up, "--gpus-per-node", type=int, default=0,
             help="GPUs each node gets (CUDA_VISIBLE_DEVICES slices, one local rank each; 0: CPU, one rank)")
    _add(up, "--http-port", type=int, default=0, help="status page port (0 picks a free one)")
    _add(up, "--timeout", type=float, default=120.0, help="seconds to wait for every node to join")
    _add(up, "--dir", env="LOCAL_DIR", default=default_local_dir(),
             help="state and logs of this cluster (env GOSSAMER_LOCAL_DIR)")
    up.set_defaults(fn="local_up")
    down = losub.add_parser("down", help="stop every process `local up` started (logs stay)")
    _add(down, "--dir", env="LOCAL_DIR", default=default_local_dir(),
               help="the directory given to `local up` (env GOSSAMER_LOCAL_DIR)")
    _add(down, "--grace", type=float, default=15.0, help="seconds the nodes get to leave before SIGKILL")
    down.set_defaults(fn="local_down")
    info = losub.add_parser("status", help="whether a local cluster is up, its address and status page")
    _add(info, "--dir", env="LOCAL_DIR", default=default_local_dir(),
               help="the directory given to `local up` (env GOSSAMER_LOCAL_DIR)")
    info.set_defaults(fn="local_status")


# --- client verbs ----------------------------------------------------------------------------------
def _client_parsers(sub: Any) -> None:
    s = sub.add_parser("submit", help="submit an experiment file (TOML)")
    s.add_argument("file", help="the experiment file (TOML; see examples/)")
    _add(s, "--wait", action="store_true", help="follow progress until it finishes")
    _add(s, "--quiet", "-q", action="store_true", help="no progress bar")
    s.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field (from the environment: GOSSAMER_EXP_<FIELD>=VALUE, which --set beats)")
    _add(s, "--workdir", default=None, metavar="DIR",
         help="ship DIR's files with the experiment: packed, stored by the coordinator, fetched by each node "
              "and put first on its roles' sys.path (docs/experiments.md) (env GOSSAMER_WORKDIR)")
    _add_client_flags(s)
    s.set_defaults(fn="submit")

    st = sub.add_parser("status", help="experiments and nodes, or one experiment")
    st.add_argument("id", nargs="?", help="an experiment id (default: every experiment and node)")
    _add(st, "--json", action="store_true", help="print JSON")
    _add_client_flags(st)
    st.set_defaults(fn="status")

    n = sub.add_parser("nodes", help="list nodes")
    _add(n, "--json", action="store_true", help="print JSON")
    _add_client_flags(n)
    n.set_defaults(fn="nodes")

    w = sub.add_parser("watch", help="a live table of an experiment until it finishes (Ctrl-C detaches)")
    w.add_argument("id", help="the experiment id")
    _add(w, "--quiet", "-q", action="store_true", help="no live table: wait, then print the outcome")
    _add(w, "--interval", type=float, default=1.0, help="seconds between refreshes")
    _add(w, "--tensorboard", metavar="DIR", default=None,
         help="append each metric point as it arrives to DIR/ID/<node>[/<rank>]/events.out.tfevents.* "
              "(the runs of `export --tensorboard`; watching again appends only newer points)")
    _add(w, "--wandb", metavar="PROJECT", default=None,
         help="log each metric point to a Weights & Biases run of PROJECT named after the experiment "
              "(WANDB_MODE=offline: written locally, `wandb sync` later)")
    _add_client_flags(w)
    w.set_defaults(fn="watch")

    lg = sub.add_parser("logs", help="a role's log and last traceback, fetched from the node that ran it")
    lg.add_argument("id", help="the experiment id")
    _add(lg, "--role", default="", metavar="ROLE",
         help="worker/N or ps/N (default: the role whose traceback is newest, else the newest log)")
    _add(lg, "--rank", type=int, default=None, help="a worker's local rank (default: the one that failed, else 0)")
    _add(lg, "--follow", "-f", action="store_true",
         help="then print what the role writes, until Ctrl-C or the experiment has finished")
    _add(lg, "--bytes", type=int, default=0, metavar="N", help="at most N bytes of log (default and most: 64 KiB)")
    _add_client_flags(lg)
    lg.set_defaults(fn="logs")

    c = sub.add_parser("cancel", help="cancel an experiment")
    c.add_argument("id", help="the experiment id")
    _add_client_flags(c)
    c.set_defaults(fn="cancel")

    ev = sub.add_parser("events", help="the event log of an experiment (failures, recoveries, discards)")
    ev.add_argument("id", help="the experiment id")
    _add(ev, "--json", action="store_true", help="print JSON")
    _add_client_flags(ev)
    ev.set_defaults(fn="events")

    pl = sub.add_parser("plot", help="loss, accuracy, throughput and bytes against time, as a PNG")
    pl.add_argument("id", help="the experiment id")
    _add(pl, "--out", "-o", default=None, help="output file (default ID.png; .svg/.pdf by suffix)")
    _add_client_flags(pl)
    pl.set_defaults(fn="plot")

    ex = sub.add_parser("export", help="an experiment's metric series as TensorBoard event files")
    ex.add_argument("id", help="the experiment id")
    _add(ex, "--tensorboard", required=True, metavar="DIR",
             help="write DIR/ID/<node>[/<rank>]/events.out.tfevents.*: one run per worker rank and shard")
    _add_client_flags(ex)
    ex.set_defaults(fn="export")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; `args.fn` names the command's handler in gossamer.tools.cli."""
    p = Parser(prog="gossamer", description="Decentralized, asynchronous, elastic training.", epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    _coordinator_parser(sub)
    _worker_parser(sub)
    _client_parsers(sub)
    _local_parser(sub)

    sesub = _verbs(sub, "security", "secure set-up (docs/security.md)")
    si = sesub.add_parser("init", help="create a CA, coordinator and client certificates and a token in DIR")
    si.add_argument("dir", help="where to write them")
    _add(si, "--san", action="append", default=[], metavar="HOST",
             help="a name or IP the coordinator is reached at (repeatable; this machine's are included)")
    _add(si, "--address", env="SECURITY_ADDRESS", default="HOST:7070", help="coordinator address to show in the instructions")
    si.set_defaults(fn="security_init")
    sv = sesub.add_parser("viewer-token", help="print the read-only token of the coordinator's status page, /api "
                                               "and /metrics, derived from the join token (docs/security.md)")
    _add(sv, "--token-file", default=None, help="file with the join token (e.g. secure/token)")
    sv.set_defaults(fn="security_viewer_token")

    d = sub.add_parser("demo", help="a whole local cluster: coordinator, shards, workers, digits in async mode")
    _add(d, "--workers", type=int, default=3, help="spot nodes, one worker each")
    _add(d, "--shards", type=int, default=2, help="on-demand nodes, one shard each")
    _add(d, "--steps", type=int, default=1500, help="total_steps")
    _add(d, "--keep", action="store_true", help="keep the demo's state directory")
    d.set_defaults(fn="demo")
    return p


def _version() -> str:
    from gossamer.core.version import __version__

    return __version__


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """`argv` parsed after `normalize_argv` (the default actions of `coordinator` and `worker`)."""
    return build_parser().parse_args(normalize_argv(argv))
