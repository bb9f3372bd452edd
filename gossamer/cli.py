"""The `gossamer` command line (also `coordinator` and `worker`); imports are lazy so servers start fast."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from gossamer.errors import GossamerError

DEFAULT_COORDINATOR = "127.0.0.1:7070"


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


def _setup_logging(level: str, fmt: str = "text", **context: str) -> None:
    from gossamer.logs import configure, set_context

    set_context(**context)
    configure(level, fmt)


# --- security ---------------------------------------------------------------------------------
def _server_security(args: argparse.Namespace) -> dict[str, Any]:
    """TLS and token paths of the coordinator; --secure DIR fills what the explicit flags leave."""
    paths = {"tls_cert": args.tls_cert, "tls_key": args.tls_key, "tls_ca": args.tls_ca, "token_file": args.token_file}
    if args.secure:
        from gossamer.security.serving import client_instructions, secure_setup

        made, created = secure_setup(args.secure, args.san, args.host)
        paths = {k: v or made[k] for k, v in paths.items()}
        host = args.host if args.host not in ("0.0.0.0", "::") else "HOST"
        lines = client_instructions(args.secure, f"{host}:{args.port or 'PORT'}")
        print(("created " if created else "using ") + "\n".join(lines), file=sys.stderr)
    return paths


def _client_security(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from gossamer.security.channel import ChannelSecurity

    return ChannelSecurity.from_flags(
        secure=args.secure, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_server_name=args.tls_server_name, token_file=args.token_file,
    )


def cmd_security_init(args: argparse.Namespace) -> int:
    from gossamer.security.certs import init_secure_dir
    from gossamer.security.serving import client_instructions

    made = init_secure_dir(args.dir, args.san)
    print(f"{'created' if made.created else 'kept the existing'} CA, certificates and token in {made.root}")
    print(f"the coordinator's certificate is valid for: {', '.join(made.server_names)}")
    print(f"coordinator: gossamer coordinator serve --host 0.0.0.0 --secure {made.root}")
    for line in client_instructions(args.dir, args.address)[1:]:
        print(line)
    return 0


def _curve_flag(args: argparse.Namespace) -> bool | None:
    """--curve/--no-curve, else GOSSAMER_CURVE, else None (the coordinator: on with TLS)."""
    if args.curve is not None:
        return bool(args.curve)
    return _env("CURVE", False) if "GOSSAMER_CURVE" in os.environ else None


# --- coordinator ------------------------------------------------------------------------------
def cmd_coordinator_serve(args: argparse.Namespace) -> int:
    import asyncio

    from gossamer.coordinator.config import CoordinatorConfig
    from gossamer.coordinator.server import serve

    _setup_logging(args.log_level, args.log_format, role="coordinator")
    config = CoordinatorConfig(
        host=args.host, port=args.port, state_dir=args.state_dir,
        heartbeat_interval_s=args.heartbeat_interval, lease_timeout_s=args.lease_timeout,
        check_imports=not args.no_import_check,
        max_message_bytes=int(args.max_message_mb * (1 << 20)), rate_limit=args.rate_limit,
        rate_burst=args.rate_burst, curve=_curve_flag(args), **_server_security(args),
    )
    http = None
    if args.http_port is not None:
        from gossamer.coordinator.http import HttpConfig

        http = HttpConfig(host=args.http_host or args.host, port=args.http_port)
    asyncio.run(serve(config, ready_file=args.ready_file, http=http))
    return 0


# --- worker -----------------------------------------------------------------------------------
def cmd_worker_join(args: argparse.Namespace) -> int:
    import asyncio

    from gossamer.worker import launcher

    # Under torchrun/srun with several processes per node, local rank 0 is the node agent and the
    # others attach to it (README "Under torchrun or srun").
    launch = launcher.detect()
    nproc = launcher.resolve_nproc(launch, args.nproc_per_node)
    if not launch.shared:  # under a launcher each rank may see only its own GPU (srun --gpus-per-task)
        launcher.check_cuda_ranks(nproc, launcher.visible_cuda_devices())
    launcher.scrub_cross_node_env(launch)
    if launch.shared:
        launcher.ensure_run_dir(args.run_dir or launcher.default_run_dir())
    if launch.shared and launch.local_rank > 0:
        from gossamer.worker.attach import run_attached_rank

        _setup_logging(args.log_level, args.log_format, role=f"rank{launch.local_rank}", node=args.name)
        return run_attached_rank(launch, launch.socket_path(args.run_dir), timeout_s=args.attach_timeout)

    from gossamer.worker.agent import AgentConfig, NodeAgent, parse_labels

    _setup_logging(args.log_level, args.log_format, role="agent", node=args.name)
    config = AgentConfig(
        coordinator=args.coordinator, name=args.name, address=args.address, security=_client_security(args),
        nproc_per_node=nproc, spot=args.spot, labels=parse_labels(args.labels),
        grace_s=args.grace, threads_per_role=args.threads, log_level=args.log_level.upper(), log_format=args.log_format,
        launch=launch, run_dir=args.run_dir, attach_timeout_s=args.attach_timeout, warm_roles=args.warm_roles,
        preload=tuple(args.preload),
    )
    if config.warm_roles:
        from gossamer.worker.warm import check_preload

        check_preload(config.preload)
    if args.metrics_port is not None:
        import dataclasses

        config = dataclasses.replace(config, metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    agent = NodeAgent(config)
    asyncio.run(agent.run())
    return agent.exit_code


# --- client verbs -----------------------------------------------------------------------------
def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from gossamer.client import Client

    client = Client.secured(args.coordinator, _client_security(args))
    client.ping(timeout=args.connect_timeout)
    return client


def _parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise GossamerError(f"--set expects field=value, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def cmd_submit(args: argparse.Namespace) -> int:
    from gossamer.experiment import Experiment

    exp = Experiment.from_toml(args.file, overrides=_parse_set(args.set))
    client = _client(args)
    job = client.submit(exp)
    print(job.id)
    if args.wait:
        from gossamer.watch import follow

        return follow(job, quiet=args.quiet)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    client = _client(args)
    console = Console()
    if args.id:
        st = client.job(args.id).status()
        if args.json:
            print(json.dumps(st, indent=1))
            return 0
        m = st["metrics"]
        console.print(f"[bold]{st['name']}[/] ({st['id']}): {st['state']}  step {st['steps']}/{st['total_steps']}"
                      f"  generation {st['generation']}")
        if st["message"]:
            console.print(f"  {st['message']}")
        evals = sorted(k for k in m if k.startswith("eval_") and k not in ("eval_step", "eval_accuracy", "eval_loss"))
        for k in ("loss", "eval_accuracy", "eval_loss", *evals, "samples", "samples_per_s", "bytes_up", "bytes_down"):
            if k in m:
                console.print(f"  {k:14s} {m[k]:.6g}")
        if st["checkpoint"]:
            console.print(f"  checkpoint     {st['checkpoint']}")
        _print_profiles(console, m)
        slow = [r for r in st["roles"] if r.get("straggler")]
        if slow:
            console.print("  [bold red]stragglers[/]     " + ", ".join(f"{r['node']} ({r['step_rate']:.2f} steps/s)" for r in slow)
                          + ": slower than half the median step rate of the workers")
        table = Table("node", "role", "index", "steps/s", "endpoint")
        for r in st["roles"]:
            role = f"{r['role']} (backup)" if r["role"] == "ps" and r.get("replica") else r["role"]
            rate = f"{r['step_rate']:.2f}" if r["role"] == "worker" and r.get("step_rate") else ""
            node = f"[red]{r['node']} (straggler)[/]" if r.get("straggler") else r["node"]
            table.add_row(node, role, str(r["index"]), rate, r["endpoint"])
        console.print(table)
        return 0
    exps = client.experiments()
    nodes = client.nodes()
    if args.json:
        print(json.dumps({"experiments": exps, "nodes": nodes}, indent=1))
        return 0
    t = Table("experiment", "state", "steps", "eval acc", "message", title="experiments")
    for e in exps:
        acc = e["metrics"].get("eval_accuracy")
        t.add_row(e["id"], e["state"], f"{e['steps']}/{e['total_steps']}",
                  "" if acc is None else f"{acc:.4f}", e["message"][:60])
    console.print(t)
    _print_nodes(console, nodes)
    return 0


def _print_profiles(console: Any, metrics: dict[str, float]) -> None:
    """The step-time split of profiled ranks (`profile_steps`), from `profile_<what>.<node>` totals."""
    from rich.table import Table

    rows: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        what, dot, node = key.removeprefix("profile_").partition(".")
        if key.startswith("profile_") and dot:
            rows.setdefault(node, {})[what] = value
    if not rows:
        return
    t = Table("node", "steps", "step", "compute", "compression", "communication", "other", title="profile")
    for node, r in sorted(rows.items()):
        t.add_row(node, f"{r.get('steps', 0):.0f}", f"{1000 * r.get('step_s', 0):.1f} ms",
                  *(f"{100 * r.get(f'{k}_frac', 0):.1f}%" for k in ("compute", "compression", "communication", "other")))
    console.print(t)


def _print_nodes(console: Any, nodes: list[dict[str, Any]]) -> None:
    from rich.table import Table

    t = Table("node", "address", "state", "role", "experiment", "spot", "lease age", title="nodes")
    for n in nodes:
        t.add_row(n["name"], n["address"], n["state"], n["role"], n["experiment"], "yes" if n["spot"] else "",
                  f"{n['lease_age_s']:.1f}s")
    console.print(t)


def cmd_nodes(args: argparse.Namespace) -> int:
    from rich.console import Console

    nodes = _client(args).nodes()
    if args.json:
        print(json.dumps(nodes, indent=1))
    else:
        _print_nodes(Console(), nodes)
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from gossamer.watch import follow, watch

    client = _client(args)
    if args.quiet:
        return follow(client.job(args.id), quiet=True)
    return watch(client, args.id, refresh_s=args.interval)


def cmd_plot(args: argparse.Namespace) -> int:
    from gossamer.plot import plot_experiment

    path = plot_experiment(_client(args).job(args.id), args.out or f"{args.id}.png")
    print(f"wrote {path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from gossamer.export import export_experiment

    path, runs = export_experiment(_client(args).job(args.id), args.tensorboard)
    print(f"wrote {sum(runs.values())} scalars in {len(runs)} runs to {path} (tensorboard --logdir {args.tensorboard})")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    st = _client(args).job(args.id).cancel()
    print(f"{st['id']}: {st['state']}")
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    events = _client(args).job(args.id).events()
    if args.json:
        print(json.dumps(events, indent=1))
        return 0
    for e in events:
        stamp = time.strftime("%H:%M:%S", time.localtime(e["time_unix"])) + f".{int(e['time_unix'] * 1000) % 1000:03d}"
        print(f"{stamp}  {e['kind']:<10} {e['message']}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gossamer.demo import run_demo

    return run_demo(workers=args.workers, shards=args.shards, total_steps=args.steps, keep=args.keep)


# --- parser -----------------------------------------------------------------------------------
def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", "-c", default=_env("COORDINATOR", DEFAULT_COORDINATOR),
                   help="coordinator HOST:PORT (env GOSSAMER_COORDINATOR)")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to wait for the coordinator")
    _add_security_flags(p, server=False)


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


def _coordinator_parser(sub: Any) -> None:
    co = sub.add_parser("coordinator", help="run the coordinator")
    cosub = co.add_subparsers(dest="action", required=True)
    s = cosub.add_parser("serve", help="serve the control plane (gRPC)")
    s.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to bind (0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=_env("PORT", 7070), help="port (0 picks a free one)")
    s.add_argument("--state-dir", default=_env("STATE_DIR", "./gossamer-state"), help="SQLite state and checkpoints")
    s.add_argument("--heartbeat-interval", type=float, default=_env("HEARTBEAT_INTERVAL", 1.0), help="seconds")
    s.add_argument("--lease-timeout", type=float, default=_env("LEASE_TIMEOUT", 10.0),
                   help="seconds without heartbeat before a node is declared lost")
    s.add_argument("--ready-file", default=None, help="write the bound port here once serving")
    s.add_argument("--no-import-check", action="store_true", help="skip importing model/dataset at submit")
    s.add_argument("--http-port", type=int, default=_env("HTTP_PORT", None),
                   help="serve the status page and Prometheus /metrics on this port (0 picks a free one, written to "
                        "STATE_DIR/http.port); off unless given (env GOSSAMER_HTTP_PORT)")
    s.add_argument("--http-host", default=_env("HTTP_HOST", ""), help="address the HTTP side binds (default: --host)")
    _add_security_flags(s, server=True)
    s.add_argument("--curve", action=argparse.BooleanOptionalAction, default=None,
                   help="CurveZMQ on the data plane: shards and gossip peers accept only the experiment's members' "
                        "keys (env GOSSAMER_CURVE; default: on when serving TLS)")
    s.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    s.add_argument("--log-format", choices=("text", "json"), default=_env("LOG_FORMAT", "text"),
                   help="text, or json: one object per line with ts, level, logger, msg, node, experiment, role"
                        " (env GOSSAMER_LOG_FORMAT)")
    s.set_defaults(fn=cmd_coordinator_serve)


def _worker_parser(sub: Any) -> None:
    wo = sub.add_parser("worker", help="run a node agent")
    wosub = wo.add_subparsers(dest="action", required=True)
    j = wosub.add_parser("join", help="join a coordinator and run the roles it assigns")
    j.add_argument("coordinator", nargs="?", default=_env("COORDINATOR", DEFAULT_COORDINATOR), help="HOST:PORT")
    j.add_argument("--name", default=_env("NAME", ""), help="node name (default hostname-id)")
    j.add_argument("--address", default=_env("ADDRESS", ""), help="address other nodes use to reach this one")
    j.add_argument("--nproc-per-node", type=int, default=_env("NPROC_PER_NODE", None),
                   help="local ranks per worker (default 1; under torchrun/srun: its processes on this node)")
    j.add_argument("--spot", action="store_true", default=_env("SPOT", False), help="preemptible machine")
    j.add_argument("--labels", nargs="*", default=[], metavar="K=V")
    j.add_argument("--grace", type=float, default=_env("GRACE", 30.0),
                   help="seconds to leave gracefully on SIGTERM (a spot notice): finish the step, hand shards over")
    j.add_argument("--threads", type=int, default=_env("THREADS", 1), help="torch threads per role process")
    j.add_argument("--run-dir", default=_env("RUN_DIR", ""),
                   help="under torchrun/srun: private directory of the socket where local ranks attach to local "
                        "rank 0's agent (default $TMPDIR/gossamer-UID; env GOSSAMER_RUN_DIR)")
    j.add_argument("--attach-timeout", type=float, default=_env("ATTACH_TIMEOUT", 120.0),
                   help="under torchrun/srun: seconds local ranks wait for each other before giving up")
    j.add_argument("--warm-roles", action=argparse.BooleanOptionalAction, default=_env("WARM_ROLES", True),
                   help="start role processes from a fork server that imports torch while the node waits, so a "
                        "role starts in milliseconds (default on; env GOSSAMER_WARM_ROLES)")
    j.add_argument("--preload", nargs="*", metavar="MODULE", default=[m for m in _env("PRELOAD", "").split(",") if m],
                   help="modules the fork server imports once for every role, e.g. transformers or your model's "
                        "module (env GOSSAMER_PRELOAD, comma-separated)")
    j.add_argument("--metrics-port", type=int, default=_env("METRICS_PORT", None),
                   help="serve this node's Prometheus /metrics on this port (0 picks a free one, logged); off unless "
                        "given (env GOSSAMER_METRICS_PORT)")
    j.add_argument("--metrics-host", default=_env("METRICS_HOST", ""),
                   help="address /metrics binds (default: --address, the one other nodes reach this node at)")
    _add_security_flags(j, server=False)
    j.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    j.add_argument("--log-format", choices=("text", "json"), default=_env("LOG_FORMAT", "text"),
                   help="text, or json: one object per line with ts, level, logger, msg, node, experiment, role"
                        " (env GOSSAMER_LOG_FORMAT)")
    j.set_defaults(fn=cmd_worker_join)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gossamer", description="Decentralized, asynchronous, elastic training.")
    sub = p.add_subparsers(dest="command", required=True)
    _coordinator_parser(sub)
    _worker_parser(sub)

    s = sub.add_parser("submit", help="submit an experiment file (TOML)")
    s.add_argument("file")
    s.add_argument("--wait", action="store_true", help="follow progress until it finishes")
    s.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    s.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a field")
    _add_client_flags(s)
    s.set_defaults(fn=cmd_submit)

    st = sub.add_parser("status", help="experiments and nodes, or one experiment")
    st.add_argument("id", nargs="?")
    st.add_argument("--json", action="store_true")
    _add_client_flags(st)
    st.set_defaults(fn=cmd_status)

    n = sub.add_parser("nodes", help="list nodes")
    n.add_argument("--json", action="store_true")
    _add_client_flags(n)
    n.set_defaults(fn=cmd_nodes)

    w = sub.add_parser("watch", help="a live table of an experiment until it finishes (Ctrl-C detaches)")
    w.add_argument("id")
    w.add_argument("--quiet", "-q", action="store_true", help="no live table: wait, then print the outcome")
    w.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    _add_client_flags(w)
    w.set_defaults(fn=cmd_watch)

    c = sub.add_parser("cancel", help="cancel an experiment")
    c.add_argument("id")
    _add_client_flags(c)
    c.set_defaults(fn=cmd_cancel)

    ev = sub.add_parser("events", help="the event log of an experiment (failures, recoveries, discards)")
    ev.add_argument("id")
    ev.add_argument("--json", action="store_true")
    _add_client_flags(ev)
    ev.set_defaults(fn=cmd_events)

    pl = sub.add_parser("plot", help="loss, accuracy, throughput and bytes against time, as a PNG")
    pl.add_argument("id")
    pl.add_argument("--out", "-o", default=None, help="output file (default ID.png; .svg/.pdf by suffix)")
    _add_client_flags(pl)
    pl.set_defaults(fn=cmd_plot)

    ex = sub.add_parser("export", help="an experiment's metric series as TensorBoard event files")
    ex.add_argument("id")
    ex.add_argument("--tensorboard", required=True, metavar="DIR",
                    help="write DIR/ID/<node>[/<rank>]/events.out.tfevents.*: one run per worker rank and shard")
    _add_client_flags(ex)
    ex.set_defaults(fn=cmd_export)

    se = sub.add_parser("security", help="secure set-up (docs/security.md)")
    sesub = se.add_subparsers(dest="action", required=True)
    si = sesub.add_parser("init", help="create a CA, coordinator and client certificates and a token in DIR")
    si.add_argument("dir")
    si.add_argument("--san", action="append", default=[], metavar="HOST",
                    help="a name or IP the coordinator is reached at (repeatable; this machine's are included)")
    si.add_argument("--address", default="HOST:7070", help="coordinator address to show in the instructions")
    si.set_defaults(fn=cmd_security_init)

    d = sub.add_parser("demo", help="a whole local cluster: coordinator, shards, workers, digits in async mode")
    d.add_argument("--workers", type=int, default=3)
    d.add_argument("--shards", type=int, default=2)
    d.add_argument("--steps", type=int, default=1500)
    d.add_argument("--keep", action="store_true", help="keep the demo's state directory")
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except GossamerError as e:
        print(f"gossamer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def coordinator_main() -> int:
    """`coordinator serve ...` == `gossamer coordinator serve ...`."""
    return main(["coordinator", *sys.argv[1:]])


def worker_main() -> int:
    """`worker join ...` == `gossamer worker join ...`."""
    return main(["worker", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
