"""`gossamer export --tensorboard`: an experiment's metric series as TensorBoard event files, one run per source."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gossamer.core.errors import GossamerError
from gossamer.tools.plot import source_label

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def run_dir(source: str, names: dict[str, str] | None = None) -> Path:
    """The run directory of a source, relative to the experiment's: its label ("w0", "w0/1", "ps/ps0")
    with every part made a safe file name."""
    node = source.partition("/")[0]
    safe = {node: _safe((names or {}).get(node, node))}
    return Path(*(_safe(part) for part in source_label(source, safe).split("/")))


def _safe(name: str) -> str:
    return _UNSAFE.sub("_", name).strip(".") or "_"


def write_tensorboard(points: Iterable[dict[str, Any]], out: str | Path,
                      names: dict[str, str] | None = None) -> dict[str, int]:
    """Write `points` (`Job.metrics()`) under `out` as TensorBoard scalars; returns the scalar count per run.

    Each source (a worker rank, a shard) is a run, `out/<label>`; each metric key a tag with
    the point's step and wall time. Values are stored as TensorBoard stores scalars
    (float32); non-finite ones are left out, as `gossamer plot` leaves them out.

    A merged point (a range of more than 5,000 points, or points older than the coordinator's
    --metrics-retention: "count", "min" and "max" dicts by key) gives each tag the bucket's
    mean at the bucket's last step and time, so the series runs on across raw and merged
    points, and `<tag>/min`, `<tag>/max` the bucket's extremes (only merged points have them).

    Raises:
        GossamerError: `tensorboard` is not installed, or `out` already holds event files
            (a second export would show every point twice).
    """
    try:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as e:
        raise GossamerError(f"export --tensorboard needs the tensorboard package ({e}): "
                            "pip install 'gossamer[tensorboard]'") from None
    root = Path(out)
    old = next(iter(root.rglob("events.out.tfevents.*")), None) if root.exists() else None
    if old is not None:
        raise GossamerError(f"{root} already holds TensorBoard event files ({old}); export to a new directory")
    by_source: dict[str, list[dict[str, Any]]] = {}
    for p in sorted(points, key=lambda p: p["time_unix"]):
        by_source.setdefault(p["source"], []).append(p)
    counts: dict[str, int] = {}
    for source, series in sorted(by_source.items()):
        run = run_dir(source, names)
        (root / run).mkdir(parents=True, exist_ok=True)
        writer = EventFileWriter(str(root / run))
        n = 0
        try:
            for p in series:
                event = point_event(p)
                if event is not None:
                    writer.add_event(event)
                    n += len(event.summary.value)
        finally:
            writer.close()
        counts[run.as_posix()] = n
    return counts


def point_event(point: dict[str, Any]) -> Any:
    """The TensorBoard Event of one point: its `scalars` at its step and wall time (None: it has none)."""
    from tensorboard.compat.proto import event_pb2, summary_pb2

    values = [summary_pb2.Summary.Value(tag=tag, simple_value=v) for tag, v in scalars(point)]
    if not values:
        return None
    return event_pb2.Event(wall_time=point["time_unix"], step=int(point["step"]), summary=summary_pb2.Summary(value=values))


def is_merged(point: dict[str, Any]) -> bool:
    """Whether `point` stands for several reported ones (`Job.metrics()` adds count, min and max)."""
    return isinstance(point.get("min"), dict)


def scalars(point: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """(tag, value) of every finite value of `point`; a merged point's min and max as `<key>/min`, `<key>/max`."""
    merged = is_merged(point)
    for key, value in point.items():
        if key in ("time_unix", "step", "source") or merged and key in ("count", "min", "max"):
            continue
        if math.isfinite(value):
            yield key, float(value)
    if merged:
        for bound in ("min", "max"):
            for key, value in point[bound].items():
                if math.isfinite(value):
                    yield f"{key}/{bound}", float(value)


@dataclass(frozen=True)
class Exported:
    """What `export_experiment` wrote: where, the scalar count per run, and how many points were merged ones."""

    path: Path
    runs: dict[str, int]
    merged: int


def export_experiment(job: Any, out: str | Path) -> Exported:
    """Fetch `job.metrics()` and write them to `out/<experiment id>` (see `write_tensorboard`).

    Several experiments exported to one `out` are runs side by side under
    `tensorboard --logdir out`.

    Raises:
        NotFoundError: unknown experiment (from the coordinator).
        GossamerError: no points yet, no tensorboard package, or event files already there.
    """
    status = job.status()  # an unknown id fails here
    points: Sequence[dict[str, Any]] = job.metrics()
    if not points:
        raise GossamerError(f"experiment {job.id} has no metric points yet ({status['state']}); "
                            "try again once it is running")
    names = {r["node_id"]: r["node"] for r in status["roles"] if r.get("node")}
    path = Path(out) / job.id
    return Exported(path, write_tensorboard(points, path, names), sum(map(is_merged, points)))
