"""The `gossamer` command line's commands (also `coordinator` and `worker`); imports are lazy so servers start fast."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from gossamer.core.errors import AuthError, ConfigError, GossamerError, UnavailableError
from gossamer.tools.cli_parser import (
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    RETENTION_FLAGS,
    parse_args,
)


def _setup_logging(level: str, fmt: str = "text", **context: str) -> None:
    from gossamer.core.logs import configure, set_context

    set_context(**context)
    configure(level, fmt)


# --- security ---------------------------------------------------------------------------------
def _server_security(args: argparse.Namespace) -> dict[str, Any]:
    """TLS and token paths of the coordinator; --secure DIR fills what the explicit flags leave."""
    paths = {"tls_cert": args.tls_cert, "tls_key": args.tls_key, "tls_ca": args.tls_ca, "token_file": args.token_file}
    if args.secure:
        from gossamer.coordinator.serving import client_instructions, secure_setup

        made, created = secure_setup(args.secure, args.san, args.host)
        paths = {k: v or made[k] for k, v in paths.items()}
        host = args.host if args.host not in ("0.0.0.0", "::") else "HOST"
        lines = client_instructions(args.secure, f"{host}:{args.port or 'PORT'}")
        print(("created " if created else "using ") + "\n".join(lines), file=sys.stderr)
    return {**paths, "viewer_token_file": args.viewer_token_file}


def _client_security(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from gossamer.security.channel import ChannelSecurity

    return ChannelSecurity.from_flags(
        secure=args.secure, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_server_name=args.tls_server_name, token_file=args.token_file,
    )


def cmd_security_init(args: argparse.Namespace) -> int:
    from gossamer.coordinator.serving import client_instructions
    from gossamer.security.certs import init_secure_dir

    made = init_secure_dir(args.dir, args.san)
    print(f"{'created' if made.created else 'kept the existing'} CA, certificates and token in {made.root}")
    print(f"the coordinator's certificate is valid for: {', '.join(made.server_names)}")
    print(f"coordinator: gossamer coordinator serve --host 0.0.0.0 --secure {made.root}")
    for line in client_instructions(args.dir, args.address)[1:]:
        print(line)
    return 0


def cmd_security_viewer_token(args: argparse.Namespace) -> int:
    from gossamer.core.errors import ConfigError
    from gossamer.security.token import derive_viewer_token, load_token

    if not args.token_file:
        raise ConfigError("token_file", "pass --token-file FILE: the join token the viewer token is derived from")
    print(derive_viewer_token(load_token(args.token_file)))
    return 0


def _retention_config(args: argparse.Namespace) -> dict[str, Any]:
    """The retention and import-check fields of CoordinatorConfig from `coordinator serve` flags."""
    out: dict[str, Any] = {field: getattr(args, flag.removeprefix("--").replace("-", "_"))
                           for flag, field, _, _ in RETENTION_FLAGS}
    return {**out, "import_check_concurrency": args.import_check_concurrency,
            "import_check_timeout_s": args.import_check_timeout,
            "workdir_max_bytes": int(args.workdir_max_mib * (1 << 20)),
            "workdir_store_bytes": int(args.workdir_store_mib * (1 << 20))}


def _curve_flag(args: argparse.Namespace) -> bool | None:
    """--curve/--no-curve (or GOSSAMER_CURVE), else None (the coordinator: on with TLS)."""
    return None if args.curve is None else bool(args.curve)


# --- coordinator ------------------------------------------------------------------------------
def cmd_coordinator_serve(args: argparse.Namespace) -> int:
    import asyncio

    from gossamer.coordinator.config import CoordinatorConfig
    from gossamer.coordinator.server import serve

    _setup_logging(args.log_level, args.log_format, role="coordinator")
    config = CoordinatorConfig(
        host=args.host, port=args.port, state_dir=args.state_dir, state=args.state, advertise=args.advertise,
        heartbeat_interval_s=args.heartbeat_interval, lease_timeout_s=args.lease_timeout,
        udp_beats=args.udp_beats, beat_port=args.beat_port,
        final_report_timeout_s=args.final_report_timeout, check_imports=not args.no_import_check,
        max_message_bytes=int(args.max_message_mb * (1 << 20)), rate_limit=args.rate_limit,
        rate_burst=args.rate_burst, curve=_curve_flag(args), **_server_security(args), **_retention_config(args),
    )
    http = None
    if args.http_port is not None:
        from gossamer.coordinator.http import HttpConfig

        http = HttpConfig(host=args.http_host, port=args.http_port)
    return asyncio.run(serve(config, ready_file=args.ready_file, http=http))


# --- worker -----------------------------------------------------------------------------------
def cmd_worker_join(args: argparse.Namespace) -> int:
    import asyncio

    from gossamer.node import launcher

    args.coordinator = args.coordinator_flag or args.coordinator
    check_address(args.coordinator)
    # Under torchrun/srun with several processes per node, local rank 0 is the node agent and the
    # others attach to it (README "Under torchrun or srun").
    launch = launcher.detect()
    nproc = launcher.resolve_nproc(launch, args.nproc_per_node)
    if not launch.shared:  # under a launcher each rank may see only its own GPU (srun --gpus-per-task)
        launcher.check_cuda_ranks(nproc, launcher.visible_cuda_devices())
    launcher.scrub_cross_node_env(launch)
    if launch.shared:
        launcher.ensure_run_dir(args.run_dir or "")
    if launch.shared and launch.local_rank > 0:
        from gossamer.node.attach import run_attached_rank

        _setup_logging(args.log_level, args.log_format, role=f"rank{launch.local_rank}", node=args.name)
        return run_attached_rank(launch, launch.socket_path(args.run_dir), timeout_s=args.attach_timeout)

    from gossamer.node.agent import AgentConfig, NodeAgent, parse_labels

    _setup_logging(args.log_level, args.log_format, role="agent", node=args.name)
    config = AgentConfig(
        coordinator=args.coordinator, join_timeout_s=args.join_timeout, name=args.name, address=args.address, security=_client_security(args),
        nproc_per_node=nproc, spot=args.spot, labels=parse_labels(args.labels),
        grace_s=args.grace, threads_per_role=args.threads, log_level=args.log_level.upper(), log_format=args.log_format,
        launch=launch, run_dir=args.run_dir, attach_timeout_s=args.attach_timeout, warm_roles=args.warm_roles,
        preload=tuple(args.preload), checkpoint_dir=args.checkpoint_dir, log_dir=args.log_dir,
    )
    if config.warm_roles:
        from gossamer.node.warm import check_preload

        check_preload(config.preload)
    if args.metrics_port is not None:
        import dataclasses

        config = dataclasses.replace(config, metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    agent = NodeAgent(config)
    asyncio.run(agent.run())
    return agent.exit_code


# --- client verbs -----------------------------------------------------------------------------
def check_address(address: str, field: str = "coordinator") -> str:
    """`address` if it is HOST:PORT (or several, comma-separated: docs/ha.md); a ConfigError naming what is missing otherwise."""
    if "," in address:
        for one in address.split(","):
            check_address(one.strip(), field)
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host or host.endswith(":") and not host.startswith("["):  # bare IPv6 has colons too
        raise ConfigError(field, f"{address!r} has no port: missing :PORT? (e.g. {address or '127.0.0.1'}:7070)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(field, f"{address!r}: the port must be a number from 1 to 65535")
    return address


def _coordinator_address(args: argparse.Namespace) -> str:
    """--local: the address `gossamer local up` recorded; else --coordinator (checked)."""
    if getattr(args, "local", False):
        from gossamer.tools.local_up import local_address

        return local_address(args.local_dir)
    return check_address(args.coordinator)


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from gossamer.tools.client import Client

    address = _coordinator_address(args)
    client = Client.secured(address, _client_security(args))
    try:
        client.ping(timeout=args.connect_timeout)
    except GossamerError as e:
        hint = " (is `gossamer local up` still running?)" if getattr(args, "local", False) else ""
        raise type(e)(f"{e}{hint}") from None
    return client


def _parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError("--set", f"expects FIELD=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def cmd_submit(args: argparse.Namespace) -> int:
    from gossamer.core.experiment import Experiment

    exp = Experiment.from_toml(args.file, overrides=_parse_set(args.set))
    client = _client(args)
    if args.workdir:
        shipped = client.upload_workdir(args.workdir)
        print(f"gossamer: shipped {args.workdir}: {shipped}", file=sys.stderr)
        exp = dataclasses.replace(exp, workdir=shipped.digest)
    job = client.submit(exp)
    print(job.id, flush=True)
    st = job.status()
    if st["state"] == "queued" and st["message"]:
        # At once, not after minutes of silence: the cluster is too small or busy (README "Use it on a cluster").
        print(f"gossamer: warning: {job.id} is queued: {st['message']}", file=sys.stderr)
    if args.wait:
        from gossamer.tools.watch import follow

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
            console.print(f"  {st['message']}", soft_wrap=True, markup=False)  # one line, for grep
        evals = sorted(k for k in m if k.startswith("eval_") and k not in ("eval_step", "eval_accuracy", "eval_loss"))
        for k in ("loss", "eval_accuracy", "eval_loss", *evals, "samples", "samples_per_s", "bytes_up", "bytes_down"):
            if k in m:
                console.print(f"  {k:14s} {m[k]:.6g}")
        if st["checkpoint"]:
            console.print(f"  checkpoint     {st['checkpoint']}")
        if m.get("ckpt_failed"):
            console.print(f"  [bold red]checkpoint writes failed: {int(m['ckpt_failed'])}[/] "
                          f"(`gossamer events {st['id']}` says why)")
        _print_profiles(console, m)
        slow = [r for r in st["roles"] if r.get("straggler")]
        if slow:
            console.print("  [bold red]stragglers[/]     " + ", ".join(f"{r['node']} ({r['step_rate']:.2f} steps/s)" for r in slow)
                          + ": slower than half the median step rate of the workers")
        table = Table("node", "role", "index", "steps/s", "endpoint")
        for r in st["roles"]:
            role = r["role"]
            if role == "ps":  # a primary says whether its backup holds every acknowledged update
                role = "ps (backup)" if r.get("replica") else "ps (replicated)" if r.get("replicated") else "ps (unreplicated)"
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
                  "" if acc is None else f"{acc:.4f}", e["message"])
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
    from gossamer.tools.live_metrics import live_sinks
    from gossamer.tools.watch import follow, outcome_line, watch

    client = _client(args)
    with live_sinks(client.job(args.id), tensorboard=args.tensorboard, wandb_project=args.wandb) as sinks:
        if args.quiet and sinks:
            from gossamer.tools.live_metrics import feed

            final = feed(client.job(args.id), sinks, refresh_s=args.interval)
            print(outcome_line(final))
            return 0 if final["state"] == "completed" else 1
        if args.quiet:
            return follow(client.job(args.id), quiet=True)
        return watch(client, args.id, refresh_s=args.interval, sinks=sinks)


def cmd_plot(args: argparse.Namespace) -> int:
    from gossamer.tools.plot import plot_experiment, require_matplotlib

    require_matplotlib()  # before reaching the coordinator: nothing to fetch for without it
    path = plot_experiment(_client(args).job(args.id), args.out or f"{args.id}.png")
    print(f"wrote {path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from gossamer.tools.export import export_experiment

    done = export_experiment(_client(args).job(args.id), args.tensorboard)
    print(f"wrote {sum(done.runs.values())} scalars in {len(done.runs)} runs to {done.path} "
          f"(tensorboard --logdir {args.tensorboard})")
    if done.merged:
        print(f"{done.merged} points came merged per source into time buckets: each tag holds the bucket's mean, "
              "TAG/min and TAG/max its extremes")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    st = _client(args).job(args.id).cancel()
    print(f"{st['id']}: {st['state']}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from gossamer.tools.show_logs import show_logs

    return show_logs(_client(args).job(args.id), role=args.role, local_rank=args.rank, follow=args.follow,
                     max_bytes=args.bytes)


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
    from gossamer.tools.demo import run_demo

    return run_demo(workers=args.workers, shards=args.shards, total_steps=args.steps, keep=args.keep)


# --- local cluster ----------------------------------------------------------------------------
def cmd_local_up(args: argparse.Namespace) -> int:
    from gossamer.tools.local_up import up

    print(f"starting a coordinator and {args.nodes} nodes ({args.nodes - args.spot} on-demand, {args.spot} spot) "
          f"in {args.dir} ...", file=sys.stderr)
    info = up(args.dir, nodes=args.nodes, spot=args.spot, gpus_per_node=args.gpus_per_node,
              http_port=args.http_port, timeout_s=args.timeout)
    print(f"coordinator   {info.address}")
    print(f"status page   {info.status_page}")
    print(f"logs          {info.log_dir}")
    print("next: gossamer submit YOUR.toml --local --wait   (then `gossamer local down` stops it all)")
    return 0


def cmd_local_down(args: argparse.Namespace) -> int:
    from gossamer.tools.local_up import down

    info, killed = down(args.dir, grace_s=args.grace)
    if info is None:
        print(f"no local cluster in {args.dir}")
        return 0
    extra = f" ({killed} processes had to be killed)" if killed else ""
    print(f"stopped the local cluster at {info.address}{extra}; logs stay in {info.log_dir}")
    return 0


def cmd_local_status(args: argparse.Namespace) -> int:
    from gossamer.tools.local_up import alive, read_info

    info = read_info(args.dir)
    if info is None or not alive(info):
        print(f"no local cluster runs from {args.dir}" + (" (its processes are gone; `gossamer local down` "
                                                           "clears the record)" if info else ""))
        return 1
    print(f"coordinator   {info.address}\nstatus page   {info.status_page}\nlogs          {info.log_dir}")
    return 0


def exit_code(error: GossamerError) -> int:
    """The exit code of a command that raised `error` (cli_parser.EPILOG lists them)."""
    if isinstance(error, UnavailableError):
        return EXIT_UNREACHABLE  # nothing wrong with the command: the same one may work once the coordinator is up
    if isinstance(error, (ConfigError, AuthError)):
        return EXIT_USAGE  # the user's input or set-up must change first
    return EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return int(COMMANDS[args.fn](args) or 0)
    except GossamerError as e:
        print(f"gossamer: error: {e}", file=sys.stderr)
        return exit_code(e)
    except KeyboardInterrupt:
        return 130


#: `args.fn` (set by gossamer.tools.cli_parser) -> the command.
COMMANDS = {
    "coordinator_serve": cmd_coordinator_serve, "worker_join": cmd_worker_join, "submit": cmd_submit,
    "status": cmd_status, "nodes": cmd_nodes, "watch": cmd_watch, "cancel": cmd_cancel, "events": cmd_events, "logs": cmd_logs,
    "plot": cmd_plot, "export": cmd_export, "security_init": cmd_security_init,
    "security_viewer_token": cmd_security_viewer_token, "demo": cmd_demo, "local_up": cmd_local_up,
    "local_down": cmd_local_down, "local_status": cmd_local_status,
}


def coordinator_main() -> int:
    """`coordinator [serve] ...` == `gossamer coordinator serve ...`."""
    return main(["coordinator", *sys.argv[1:]])


def worker_main() -> int:
    """`worker [join] ...` == `gossamer worker join ...`."""
    return main(["worker", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
