"""A run's metric points as they arrive (`gossamer watch --tensorboard DIR --wandb PROJECT`): TensorBoard event files and a W&B run."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from gossamer.core.errors import MissingExtraError, UnavailableError
from gossamer.tools.export import point_event, run_dir, scalars
from gossamer.tools.plot import source_label

__all__ = ["MetricSink", "NewPoints", "TensorBoardSink", "WandbSink", "feed", "live_sinks", "node_names"]

_FINISHED = ("completed", "failed", "cancelled")
#: Points are stamped by their sources' clocks and may arrive late: each poll asks this much further back.
LATE_MARGIN_S = 5.0
#: Where a TensorBoard sink keeps the newest time written per source, so a watch started again appends only newer points.
_CURSOR = ".gossamer-live.json"


class MetricSink(Protocol):
    """Where `watch` hands each new point once."""

    def write(self, points: Sequence[dict[str, Any]], names: dict[str, str]) -> None:
        """Take `points` (`Job.metrics()` dicts, oldest first); `names` maps node ids to node names."""

    def close(self) -> None: ...


class NewPoints:
    """The points of a run not taken yet, from the same metric stream as `status`, `watch` and `plot`.

    Each call asks the coordinator for the points since the newest taken less `LATE_MARGIN_S`,
    and drops those already taken.
    """

    def __init__(self, job: Any) -> None:
        self.job = job
        self.since = 0.0
        self._seen: set[tuple[str, float, int]] = set()

    def __call__(self) -> list[dict[str, Any]]:
        points = [p for p in self.job.metrics(since_unix=max(0.0, self.since - LATE_MARGIN_S))
                  if (p["source"], p["time_unix"], p["step"]) not in self._seen]
        self._seen = {k for k in self._seen if k[1] >= self.since - LATE_MARGIN_S}
        self._seen.update((p["source"], p["time_unix"], p["step"]) for p in points)
        self.since = max([self.since, *(p["time_unix"] for p in points)])
        return sorted(points, key=lambda p: p["time_unix"])


def node_names(status: dict[str, Any]) -> dict[str, str]:
    """Node id -> node name of the roles a status lists (run directories and W&B keys are named by node)."""
    return {r["node_id"]: r["node"] for r in status.get("roles", ()) if r.get("node")}


class TensorBoardSink:
    """Appends each point to `out/<experiment>/<run>/events.out.tfevents.*` as it arrives, flushed at once.

    The runs are those of `gossamer export --tensorboard` (one per worker rank and shard, each
    metric a tag, merged points' extremes as `TAG/min`, `TAG/max`), so `tensorboard --logdir out`
    shows a run while it trains. A source's run directory is fixed at its first point. The newest
    time written per source is kept beside the runs: a sink opened again on the same directory
    writes only newer points (a new event file in each run, which TensorBoard reads together).

    Raises:
        MissingExtraError: `tensorboard` is not installed.
    """

    def __init__(self, out: str | os.PathLike[str], experiment_id: str) -> None:
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise MissingExtraError("tensorboard", "tensorboard", "live TensorBoard files (--tensorboard)") from None
        self._writer_class = EventFileWriter
        self.root = Path(out) / experiment_id
        self.root.mkdir(parents=True, exist_ok=True)
        self._writers: dict[str, Any] = {}
        self._runs: dict[str, Path] = {}
        self.written = 0  # scalars
        try:
            self._newest: dict[str, float] = json.loads((self.root / _CURSOR).read_text())
        except (OSError, ValueError):
            self._newest = {}

    def write(self, points: Sequence[dict[str, Any]], names: dict[str, str]) -> None:
        touched = set()
        for p in points:
            source = p["source"]
            if p["time_unix"] <= self._newest.get(source, -1.0):
                continue
            event = point_event(p)
            self._newest[source] = p["time_unix"]
            if event is None:
                continue
            self._writer(source, names).add_event(event)
            self.written += len(event.summary.value)
            touched.add(source)
        for source in touched:
            self._writers[source].flush()  # readers see the point now, not at the writer's 2-minute flush
        if touched:
            tmp = self.root / f"{_CURSOR}.tmp"
            tmp.write_text(json.dumps(self._newest))
            tmp.replace(self.root / _CURSOR)

    def _writer(self, source: str, names: dict[str, str]) -> Any:
        if source not in self._writers:
            run = self.root / run_dir(source, names)
            run.mkdir(parents=True, exist_ok=True)
            self._runs[source] = run
            self._writers[source] = self._writer_class(str(run))
        return self._writers[source]

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()


class WandbSink:
    """Logs each point to a Weights & Biases run named after the experiment.

    Keys are `<source label>/<metric>` (`w0/loss`, `ps/ps0/updates`), each source's against its
    own `<label>/step`, since sources report different steps at different times. The run's
    config is the experiment's fields. `WANDB_MODE=offline` writes the run under `directory`
    (`wandb sync` uploads it later) and needs no network.

    Raises:
        MissingExtraError: `wandb` is not installed.
    """

    def __init__(self, project: str, experiment_id: str, *, name: str = "", config: dict[str, Any] | None = None,
                 directory: str | os.PathLike[str] | None = None) -> None:
        try:
            import wandb
        except ImportError:
            raise MissingExtraError("wandb", "wandb", "the Weights & Biases logger (--wandb)") from None
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name or experiment_id, config=config or {},
                              tags=[experiment_id], dir=None if directory is None else str(directory))
        self._labels: dict[str, str] = {}

    def write(self, points: Sequence[dict[str, Any]], names: dict[str, str]) -> None:
        for p in points:
            label = self._label(p["source"], names)
            row = {f"{label}/{k}": v for k, v in scalars(p)}
            if row:
                self.run.log({**row, f"{label}/step": int(p["step"])})

    def _label(self, source: str, names: dict[str, str]) -> str:
        if source not in self._labels:
            label = source_label(source, names)
            self.run.define_metric(f"{label}/*", step_metric=f"{label}/step")
            self._labels[source] = label
        return self._labels[source]

    def close(self) -> None:
        self.run.finish()


def feed(job: Any, sinks: Sequence[MetricSink], *, refresh_s: float = 1.0,
         stop: threading.Event | None = None) -> dict[str, Any]:
    """Hand every new point of `job` to `sinks` until it finishes (or `stop` is set); its last status.

    A coordinator that does not answer is asked again at the next refresh.

    Raises:
        NotFoundError: unknown experiment.
    """
    stop = stop or threading.Event()
    new = NewPoints(job)
    status = job.status()  # an unknown id fails here
    while True:
        try:
            status = job.status()  # before the points: a finished run's last points are in the answer
            points = new()
        except UnavailableError:
            stop.wait(refresh_s)
            continue
        for sink in sinks:
            sink.write(points, node_names(status))
        if status["state"] in _FINISHED or stop.is_set():
            return status
        stop.wait(refresh_s)


@contextlib.contextmanager
def live_sinks(job: Any, *, tensorboard: str | None = None, wandb_project: str | None = None) -> Iterator[list[MetricSink]]:
    """The sinks `gossamer watch` was asked for, closed at the end (none asked: an empty list, no status fetched).

    Raises:
        MissingExtraError: the package of a sink asked for is not installed.
        NotFoundError: unknown experiment (with a W&B sink, whose config is the experiment's fields).
    """
    sinks: list[MetricSink] = []
    try:
        if tensorboard or wandb_project:
            spec = job.spec()  # an unknown id fails here, before any file is made
        if tensorboard:
            sinks.append(TensorBoardSink(tensorboard, job.id))
        if wandb_project:
            sinks.append(WandbSink(wandb_project, job.id, name=spec.get("name") or job.id, config=spec))
        yield sinks
    finally:
        for sink in sinks:
            sink.close()
