"""`gossamer watch ID`: a live table of an experiment (progress, accuracy, throughput, bytes, one row per role); `follow`, the progress bar of `submit --wait`."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from gossamer.core.errors import UnavailableError

if TYPE_CHECKING:
    from gossamer.tools.live_metrics import MetricSink

_FINISHED = ("completed", "failed", "cancelled")
_RATE_WINDOW_S = 10.0  # a role's step rate is measured over its reports of the last 10 s
_STATE_STYLE = {"running": "green", "completed": "bold green", "failed": "bold red", "cancelled": "yellow",
                "starting": "cyan", "queued": "cyan"}


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _num(m: dict[str, float], key: str, fmt: str = ".4f") -> str:
    v = m.get(key)
    return "-" if v is None or not math.isfinite(v) else format(v, fmt)


def _duration(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def stragglers(status: dict[str, Any], nodes: Sequence[dict[str, Any]] = ()) -> set[str]:
    """Node ids and names the coordinator flags as stragglers, in whichever place the status
    carries them: a top-level `stragglers` list (names, ids or dicts), or a truthy
    `straggler` on a role or a node."""
    out: set[str] = set()
    for s in status.get("stragglers") or ():
        if isinstance(s, dict):
            out.update(str(s[k]) for k in ("node", "node_id", "name", "id") if s.get(k))
        else:
            out.add(str(s))
    for r in status.get("roles", ()):
        if r.get("straggler"):
            out.update(x for x in (r.get("node"), r.get("node_id")) if x)
    for n in nodes:
        if n.get("straggler"):
            out.update(x for x in (n.get("name"), n.get("id")) if x)
    return out


@dataclass
class _Track:
    """One metric source's recent (time, steps) reports."""

    history: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=128))
    latest: dict[str, float] = field(default_factory=dict)

    def add(self, t: float, values: dict[str, Any], steps_key: str) -> None:
        self.latest.update({k: v for k, v in values.items() if isinstance(v, (int, float))})
        if steps_key in values:
            self.history.append((t, float(values[steps_key])))

    def rate(self) -> float | None:
        """Steps per second over the last `_RATE_WINDOW_S` seconds of reports."""
        if len(self.history) < 2:
            return None
        t_end, v_end = self.history[-1]
        t0, v0 = next((t, v) for t, v in self.history if t >= t_end - _RATE_WINDOW_S)
        if t_end - t0 <= 0:
            t0, v0 = self.history[-2]
        # A restarted process counts from 0 again: no negative rates.
        return max(0.0, (v_end - v0) / (t_end - t0)) if t_end > t0 else None


class WatchView:
    """What `gossamer watch` shows, built from the status, new metric points and the node list."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {}
        self.nodes: list[dict[str, Any]] = []
        self.tracks: dict[str, _Track] = {}
        self.note = ""

    @staticmethod
    def _steps_key(source: str) -> str:
        return "ps_updates" if source.rpartition("/")[2].startswith("ps") else "updates"

    def update(self, status: dict[str, Any] | None = None, points: Sequence[dict[str, Any]] = (),
               nodes: Sequence[dict[str, Any]] | None = None) -> None:
        if status is not None:
            self.status = status
        if nodes is not None:
            self.nodes = list(nodes)
        for p in sorted(points, key=lambda p: p["time_unix"]):
            src = p["source"]
            self.tracks.setdefault(src, _Track()).add(p["time_unix"], p, self._steps_key(src))

    def _staleness(self) -> str:
        """Versions behind of the updates the shards applied (their reports, over the run)."""
        means = [t.latest["staleness_mean"] for t in self.tracks.values() if "staleness_mean" in t.latest]
        maxes = [t.latest["staleness_max"] for t in self.tracks.values() if "staleness_max" in t.latest]
        if not means:
            return "-"
        return f"mean {sum(means) / len(means):.2f}, max {max(maxes, default=0):.0f} versions"

    def header(self) -> RenderableType:
        st, m = self.status, self.status.get("metrics", {})
        state = st.get("state", "?")
        title = Text.assemble((st.get("name", ""), "bold"), f" ({st.get('id', '')})  ",
                              (state, _STATE_STYLE.get(state, "")), f"  generation {st.get('generation', 0)}")
        started = st.get("started_unix") or 0.0
        if started:
            end = st.get("finished_unix") or time.time()
            title.append(f"  elapsed {_duration(end - started)}")
        total, steps = int(st.get("total_steps") or 0), int(st.get("steps") or 0)
        bar = Table.grid(padding=(0, 1))
        bar.add_column(width=6)
        bar.add_column(width=50)
        bar.add_column()
        pct = f"{100 * steps / total:.0f}%" if total else ""
        bar.add_row("step", ProgressBar(total=max(1, total), completed=min(steps, total), width=50),
                    f"{steps}/{total} {pct}")
        ratio = m.get("compression_ratio")

        def line(*pairs: tuple[str, str]) -> Text:
            return Text("   ").join(Text.assemble((f"{k} ", "dim"), v) for k, v in pairs)

        lines = [
            line(("loss", _num(m, "loss")), ("eval accuracy", _num(m, "eval_accuracy")),
                 ("eval loss", _num(m, "eval_loss")),
                 *((k.removeprefix("eval_").replace("_", " "), _num(m, k)) for k in _other_evals(m))),
            line(("samples/s", _num(m, "samples_per_s", ".0f")), ("bytes up", _bytes(m.get("bytes_up", 0.0))),
                 ("down", _bytes(m.get("bytes_down", 0.0))), ("compression", "-" if not ratio else f"{ratio:.1f}x")),
        ]
        if self._staleness() != "-":
            lines.append(line(("staleness", self._staleness())))
        grid = Group(*lines)
        parts: list[RenderableType] = [title, bar, grid]
        if st.get("message"):
            parts.append(Text(st["message"], style="dim"))
        if self.note:
            parts.append(Text(self.note, style="yellow"))
        return Group(*parts)

    def roles_table(self) -> Table:
        slow = stragglers(self.status, self.nodes)
        ages = {n["id"]: n.get("lease_age_s") for n in self.nodes}
        t = Table("node", "role", "steps", "steps/s", "last seen", "", title="roles", title_justify="left")
        for r in sorted(self.status.get("roles", ()), key=lambda r: (r["role"] != "worker", r["index"], r["replica"])):
            if r["role"] == "ps":
                role = f"ps {r['index']}" + (" (backup)" if r.get("replica") else "")
                track = self.tracks.get(f"{r['node_id']}/ps{r['index']}")
            else:
                role = f"worker {r['index']}"
                track = self.tracks.get(f"{r['node_id']}/0")
            steps = track.history[-1][1] if track and track.history else None
            rate = track.rate() if track else None
            age = ages.get(r["node_id"])
            flag = Text("straggler", style="bold red") if {r.get("node"), r.get("node_id")} & slow else ""
            t.add_row(r.get("node") or r["node_id"], role, "-" if steps is None else f"{steps:.0f}",
                      "-" if rate is None else f"{rate:.1f}", "-" if age is None else f"{age:.1f}s ago", flag)
        return t

    def render(self) -> RenderableType:
        return Group(self.header(), self.roles_table())

    def summary(self) -> RenderableType:
        """The final lines once the experiment has finished."""
        st, m = self.status, self.status.get("metrics", {})
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        state = st.get("state", "?")
        t.add_row(Text(state, style=_STATE_STYLE.get(state, "")), st.get("message", ""))
        t.add_row("steps", f"{int(st.get('steps') or 0)}/{int(st.get('total_steps') or 0)}")
        for key, label, fmt in (("eval_accuracy", "eval accuracy", ".4f"), ("eval_loss", "eval loss", ".4f"),
                                *((k, "eval " + k.removeprefix("eval_").replace("_", " "), ".4g") for k in _other_evals(m)),
                                ("samples", "samples", ".0f")):
            if key in m:
                t.add_row(label, format(m[key], fmt))
        if "bytes_up" in m:
            t.add_row("bytes", f"up {_bytes(m['bytes_up'])}, down {_bytes(m.get('bytes_down', 0.0))}")
        if m.get("compression_ratio"):
            t.add_row("compression", f"{m['compression_ratio']:.1f}x")
        if st.get("started_unix") and st.get("finished_unix"):
            t.add_row("wall time", _duration(st["finished_unix"] - st["started_unix"]))
        if st.get("checkpoint"):
            t.add_row("checkpoint", st["checkpoint"])
        return t


def detached_note(status: dict[str, Any]) -> str:
    """What happens to an experiment one stops following, by its state."""
    state = status.get("state", "")
    if state == "queued":
        why = status.get("message") or "waiting for nodes"
        return f"it stays queued ({why})"
    if state == "starting":
        return "it keeps starting (its shards are coming up)"
    return "it keeps running"


def outcome_line(status: dict[str, Any]) -> str:
    """"STATE: message", and "(step N/TOTAL)" for a run that did not complete: how far it got."""
    steps, total = int(status.get("steps") or 0), int(status.get("total_steps") or 0)
    reached = "" if status.get("state") == "completed" else f" (step {steps}/{total})"
    return f"{status.get('state')}: {status.get('message', '')}{reached}"


@contextlib.contextmanager
def ctrl_c() -> Iterator[threading.Event]:
    """Ctrl-C sets an event the loop checks instead of raising KeyboardInterrupt wherever it lands.

    Raised inside a gRPC call or rich's Live refresh, it once left `gossamer watch` still
    running 30 s after Ctrl-C (a clean-checkout run of tests/integration/test_plot_cli.py).
    """
    event = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield event
        return
    previous = signal.signal(signal.SIGINT, lambda *_: event.set())
    try:
        yield event
    finally:
        signal.signal(signal.SIGINT, previous)


def watch(client: Any, experiment_id: str, *, refresh_s: float = 1.0, console: Console | None = None,
          out: Console | None = None, sinks: Sequence[MetricSink] = ()) -> int:
    """Follow an experiment in a live table until it finishes; print the final summary.

    `sinks` (`live_metrics`: TensorBoard files, a W&B run) get each new point as the table does.

    Ctrl-C detaches (the experiment keeps running). Returns 0 when it completed, 1 when
    it failed or was cancelled, 130 when detached.

    Raises:
        NotFoundError: unknown experiment.
    """
    from gossamer.tools.live_metrics import NewPoints, node_names

    job = client.job(experiment_id)
    view = WatchView()
    view.update(status=job.status())  # an unknown id fails here, before the live display starts
    console = console or Console(stderr=True)
    out = out or Console()
    new_points = NewPoints(job)
    with ctrl_c() as detach:
        console.print(f"following {experiment_id}; Ctrl-C detaches (the experiment goes on)", style="dim")
        with Live(view.render(), console=console, refresh_per_second=4, transient=False) as live:
            while not detach.is_set():
                try:
                    status = job.status()
                    points = new_points()
                    nodes = client.nodes()
                    view.note = ""
                except UnavailableError as e:
                    view.note = f"{e}; retrying"
                    live.update(view.render())
                    detach.wait(refresh_s)
                    continue
                for sink in sinks:  # every point once, as the table takes it
                    sink.write(points, node_names(status))
                view.update(status, points, nodes)
                live.update(view.render())
                if status["state"] in _FINISHED:
                    break
                detach.wait(refresh_s)
        if not console.is_terminal:
            console.line()  # a Live that could not redraw in place leaves its last frame unterminated
    if detach.is_set():
        out.print(f"detached from {experiment_id}; {detached_note(view.status)} (`gossamer watch {experiment_id}` "
                  "follows it again, `gossamer cancel` stops it)")
        return 130
    out.print(view.summary())
    return 0 if view.status.get("state") == "completed" else 1


def follow(job: Any, quiet: bool = False) -> int:
    """Live progress bar until the experiment finishes; exit code 0 only if it completed."""
    console = Console(stderr=True)
    final: dict[str, Any] = {}
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"),
        console=console, disable=quiet, transient=False,
    ) as progress:
        task = progress.add_task(job.id, total=None, info="", eta="-")
        t_start: tuple[float, int] | None = None
        said = ""
        for st in job.watch():
            final = st
            if st["state"] in ("queued", "starting") and st["message"] and st["message"] != said:
                said = st["message"]  # what it waits for, each time that changes (also with --quiet)
                console.print(f"{job.id} {st['state']}: {said}", style="yellow", soft_wrap=True)
            m = st["metrics"]
            info = [st["state"]]
            if "loss" in m:
                info.append(f"loss {m['loss']:.4f}")
            if "eval_accuracy" in m:
                info.append(f"acc {m['eval_accuracy']:.4f}")
            elif "eval_loss" in m:
                info.append(f"eval loss {m['eval_loss']:.4g}")
            if m.get("samples_per_s"):
                info.append(f"{m['samples_per_s']:.0f} samples/s")
            eta = "-"
            if st["state"] == "running" and st["steps"] > 0:
                now = time.monotonic()
                if t_start is None:
                    t_start = (now, st["steps"])
                elif st["steps"] > t_start[1]:
                    rate = (st["steps"] - t_start[1]) / (now - t_start[0])
                    eta = f"{(st['total_steps'] - st['steps']) / rate:.0f}s"
            progress.update(task, total=st["total_steps"], completed=st["steps"], info="  ".join(info), eta=eta)
    m = final.get("metrics", {})
    print(outcome_line(final))
    if "eval_accuracy" in m:
        print(f"final eval accuracy: {m['eval_accuracy']:.4f}")
    for k in ("eval_loss", *_other_evals(m)):
        if k in m:
            print(f"final {k.replace('_', ' ')}: {m[k]:.6g}")
    if final.get("checkpoint"):
        print(f"checkpoint: {final['checkpoint']}")
    return 0 if final.get("state") == "completed" else 1


def _other_evals(m: dict[str, Any]) -> list[str]:
    """The evaluation figures besides accuracy and loss (perplexity, the experiment's own `metrics`)."""
    return sorted(k for k in m if k.startswith("eval_") and k not in ("eval_step", "eval_accuracy", "eval_loss"))
