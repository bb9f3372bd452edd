"""`gossamer plot`: an experiment's time series as four panels (loss, accuracy, throughput, bytes) in a PNG."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gossamer.core.errors import GossamerError, MissingExtraError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Series = tuple[list[float], list[float]]

#: A source's rate counts towards the total only this long after its last report (a worker
#: that left stops counting; workers report about once a second).
_RATE_TTL_S = 5.0


def require_matplotlib() -> None:
    """Raise MissingExtraError naming the [plot] extra unless matplotlib can be imported (without importing it)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingExtraError("matplotlib", "plot", "gossamer plot")


def _worker_sources(points: Sequence[dict[str, Any]], key: str) -> list[str]:
    return sorted({p["source"] for p in points if key in p})


def source_label(source: str, names: dict[str, str] | None = None) -> str:
    """A metric source, "node_id/rank" (or "node_id/psN"), as the node's name (and the rank unless 0)."""
    node, _, rank = source.partition("/")
    return (names or {}).get(node, node) + (f"/{rank}" if rank not in ("", "0") else "")


def _series(points: Sequence[dict[str, Any]], key: str, t0: float, source: str | None = None) -> Series:
    xs, ys = [], []
    for p in points:
        if key in p and (source is None or p["source"] == source) and math.isfinite(p[key]):
            xs.append(p["time_unix"] - t0)
            ys.append(float(p[key]))
    return xs, ys


def summed_latest(points: Sequence[dict[str, Any]], key: str, t0: float, ttl_s: float | None = None) -> Series:
    """The sum over sources of each source's latest `key`, after every point that carries it.

    Counters (bytes_up) give the experiment's cumulative total; rates (samples_per_s) the
    experiment's rate, where a source stops counting `ttl_s` after its last report.
    """
    latest: dict[str, tuple[float, float]] = {}
    xs, ys = [], []
    for p in sorted((p for p in points if key in p), key=lambda p: p["time_unix"]):
        t = p["time_unix"]
        latest[p["source"]] = (t, float(p[key]))
        live = (v for ts, v in latest.values() if ttl_s is None or t - ts <= ttl_s)
        xs.append(t - t0)
        ys.append(sum(live))
    return xs, ys


def render(points: Sequence[dict[str, Any]], title: str = "", names: dict[str, str] | None = None,
           t0: float | None = None) -> Figure:
    """Four panels against wall time: loss (train per worker, eval), eval accuracy,
    throughput (samples/s, all workers), cumulative bytes up and down (all workers).

    Args:
        points: `Job.metrics()` (dicts with time_unix, step, source and values).
        title: figure title (the experiment id).
        names: node id -> node name, to label each worker's line by name.
        t0: the time (unix) the x axis counts from; default the first point's.

    Raises:
        GossamerError: no points.
    """
    if not points:
        raise GossamerError("no metric points to plot")
    require_matplotlib()
    # No pyplot: no global state, and the Agg canvas whatever backend the user configured.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if t0 is None:
        t0 = min(p["time_unix"] for p in points)
    fig = Figure(figsize=(11, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    (ax_loss, ax_acc), (ax_rate, ax_bytes) = fig.subplots(2, 2, sharex=True)
    if title:
        fig.suptitle(title)

    workers = sorted((source_label(src, names), src) for src in _worker_sources(points, "loss"))
    for label, src in workers:
        ax_loss.plot(*_series(points, "loss", t0, src), lw=1, alpha=0.8,
                     label=f"train {label}" if len(workers) <= 6 else None)
    if len(workers) > 6:
        ax_loss.plot([], [], color="C0", label=f"train ({len(workers)} workers)")
    ax_loss.plot(*_series(points, "eval_loss", t0), "k.-", lw=2, label="eval")
    ax_loss.set(title="loss", ylabel="cross-entropy")

    others = sorted({k for p in points for k in p if k.startswith("eval_")}
                    - {"eval_step", "eval_loss", "eval_accuracy"})
    if any("eval_accuracy" in p for p in points) or not others:
        ax_acc.plot(*_series(points, "eval_accuracy", t0), "C2.-", lw=2, label="eval accuracy")
        ax_acc.set(title="eval accuracy", ylabel="accuracy")
    else:  # no classification: the experiment's other evaluation figures (perplexity, its own metrics)
        for i, k in enumerate(others):
            ax_acc.plot(*_series(points, k, t0), f"C{2 + i}.-", lw=2, label=k.removeprefix("eval_"))
        ax_acc.set(title="eval metrics", ylabel="value")

    ax_rate.plot(*summed_latest(points, "samples_per_s", t0, ttl_s=_RATE_TTL_S), "C1", drawstyle="steps-post",
                 label="all workers")
    ax_rate.set(title="throughput", ylabel="samples/s", xlabel="seconds since start")

    up, down = summed_latest(points, "bytes_up", t0), summed_latest(points, "bytes_down", t0)
    ax_bytes.plot(up[0], [b / 1e6 for b in up[1]], "C3", drawstyle="steps-post", label="up (sent)")
    ax_bytes.plot(down[0], [b / 1e6 for b in down[1]], "C4", drawstyle="steps-post", label="down (received)")
    ax_bytes.set(title="bytes, cumulative", ylabel="MB", xlabel="seconds since start")

    for ax in (ax_loss, ax_acc, ax_rate, ax_bytes):
        ax.grid(alpha=0.3)
        if any(len(line.get_xdata()) for line in ax.get_lines()):  # type: ignore[arg-type]
            if ax.get_legend_handles_labels()[1]:
                ax.legend(fontsize="small", loc="best")
        else:
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="grey")
    return fig


def plot_to_file(points: Iterable[dict[str, Any]], out: str | Path, title: str = "",
                 names: dict[str, str] | None = None, t0: float | None = None) -> Path:
    """Render `points` and write the figure (PNG, or any format matplotlib knows by suffix)."""
    path = Path(out)
    fig = render(list(points), title=title, names=names, t0=t0)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def plot_experiment(job: Any, out: str | Path) -> Path:
    """Fetch `job.metrics()` and write the four panels to `out`.

    Raises:
        NotFoundError: unknown experiment (from the coordinator).
        GossamerError: the experiment has reported no points yet.
    """
    status = job.status()  # an unknown id fails here
    points = job.metrics()
    if not points:
        raise GossamerError(f"experiment {job.id} has no metric points yet ({status['state']}); "
                            "try again once it is running")
    names = {r["node_id"]: r["node"] for r in status["roles"] if r.get("node")}
    return plot_to_file(points, out, title=f"{status['name']} ({job.id}): {status['state']}", names=names,
                        t0=status.get("started_unix") or None)
