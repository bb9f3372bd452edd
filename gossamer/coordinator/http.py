"""The coordinator's HTTP side: Prometheus /metrics, the status page, its JSON API and /healthz."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gossamer.coordinator._status_page import PAGE
from gossamer.coordinator.http_auth import TokenGate
from gossamer.coordinator.metrics import node_state_label, render, role_label, state_label
from gossamer.coordinator.stragglers import STRAGGLER_FRACTION, worker_speeds
from gossamer.core.errors import ConfigError
from gossamer.security.token import load_token
from gossamer.transport.httpserver import Handler, HttpServer, Request, Response
from gossamer.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from gossamer.coordinator.core import Coordinator
    from gossamer.coordinator.records import ExpRec

#: Points per chart series (?max_points= asks for another number, up to MAX_POINTS_CAP); longer
#: runs are averaged into this many time buckets.
MAX_POINTS = 300
MAX_POINTS_CAP = 2000
#: A source's value counts towards a bucket for this long after it was reported.
CARRY_S = 3.0
#: Where a viewer token derived from the join token is written, under the state dir (0600).
VIEWER_TOKEN_FILE = "viewer.token"


@dataclass(frozen=True, kw_only=True)
class HttpConfig:
    """`coordinator serve --http-port/--http-host`: where the status page and /metrics are served."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("http_port", f"must be in 0..65535, got {self.port}")
        if not self.host:
            raise ConfigError("http_host", "must be an address to bind")


class StatusHttp:
    """Routes of the coordinator's HTTP server, reading `coord` on the coordinator's event loop."""

    def __init__(self, coord: Coordinator, config: HttpConfig) -> None:
        self.c = coord
        self.config = config
        self.serving = True
        routes: dict[str, Handler] = {"/": self._page, "/index.html": self._page, "/metrics": self._metrics, "/healthz": self._healthz,
                  "/api/status": self._status, "/api/series": self._series}
        self.gate: TokenGate | None = None
        viewer = coord.config.viewer_token()
        if viewer is not None:  # every route only reads: the viewer token opens them, and so does the join token
            token_file = coord.config.token_file
            self.gate = TokenGate(viewer, join=load_token(token_file) if token_file else None)
            routes = {path: self.gate.guard(path, handler) for path, handler in routes.items()}
        self.server = HttpServer(routes, host=config.host, port=config.port)

    async def start(self) -> int:
        return await self.server.start()

    async def stop(self) -> None:
        self.serving = False
        await self.server.stop()

    async def _page(self, req: Request) -> Response:
        return Response(PAGE.encode(), content_type="text/html; charset=utf-8")

    async def _metrics(self, req: Request) -> Response:
        return Response(render(self.c), content_type=CONTENT_TYPE_LATEST)

    async def _healthz(self, req: Request) -> Response:
        return Response.text("ok\n") if self.serving else Response.text("shutting down\n", 503)

    async def _status(self, req: Request) -> Response:
        return _json(status_snapshot(self.c))

    async def _series(self, req: Request) -> Response:
        exp_id = req.query.get("experiment", "")
        exp = self.c.exps.get(exp_id)
        if exp is None:
            return _json({"error": f"experiment {exp_id!r} does not exist"}, 404)
        try:
            limit = int(req.query.get("max_points", MAX_POINTS))
        except ValueError:
            return _json({"error": "max_points must be an integer"}, 400)
        limit = min(max(limit, 10), MAX_POINTS_CAP)
        # Merged in SQL to about `limit` points per source, then into `limit` buckets here.
        rows, merged_s = await self.c.store.metric_rows(exp.id, max_points=limit, per_source=True)
        start = exp.started_unix or exp.created_unix
        return _json({"experiment": exp.id, "start_unix": start,
                      **series(rows, start, limit, carry_s=max(CARRY_S, 1.5 * merged_s))})


def status_snapshot(coord: Coordinator, now: float | None = None) -> dict[str, Any]:
    """What the status page shows: nodes, experiments with roles, step rates and stragglers."""
    now = time.time() if now is None else now
    straggling: dict[str, str] = {}  # node id -> experiment it straggles in
    exps = []
    for e in sorted(coord.exps.values(), key=lambda e: e.seq, reverse=True):
        rates, slow = worker_speeds(coord.step_rates, e, now)
        straggling.update({n: e.id for n in slow})
        exps.append(_experiment(coord, e, rates, slow))
    nodes = []
    for n in sorted(coord.nodes.values(), key=lambda n: n.joined_unix):
        exp = coord.exps.get(n.experiment_id)
        roles = sorted({role_label(r.role) for r in exp.roles if r.node_id == n.id}) if exp else []
        nodes.append({
            "id": n.id, "name": n.name, "address": n.address, "state": node_state_label(n.state),
            "roles": roles, "experiment": n.experiment_id, "spot": n.spot, "labels": n.labels,
            "lease_age_s": max(0.0, now - n.last_seen) if n.alive else None,
            "straggler": n.id in straggling,
        })
    return {"time_unix": now, "straggler_fraction": STRAGGLER_FRACTION, "experiments": exps, "nodes": nodes}


def _experiment(coord: Coordinator, e: ExpRec, rates: dict[str, float], slow: set[str]) -> dict[str, Any]:
    spec = e.spec
    names = {n.id: n.name for n in coord.nodes.values()}
    roles = []
    for r in sorted(e.roles, key=lambda r: (r.role, r.index, r.replica)):
        roles.append({
            "node": names.get(r.node_id, r.node_id), "node_id": r.node_id, "role": role_label(r.role),
            "index": r.index, "replica": r.replica,
            "state": pb.RoleState.Name(r.state).removeprefix("ROLE_STATE_").lower(), "endpoint": r.endpoint,
            "step_rate": rates.get(r.node_id) if r.role == pb.ROLE_WORKER else None,
            "straggler": r.role == pb.ROLE_WORKER and r.node_id in slow,
            "replicated": r.role == pb.ROLE_PARAMETER_SERVER and r.replica == 0 and r.replicated,
        })
    return {
        "id": e.id, "name": e.name, "state": state_label(e.state), "mode": spec.get("mode", ""),
        "compression": spec.get("compression", ""), "steps": e.steps, "total_steps": spec.get("total_steps", 0),
        "generation": e.generation, "message": e.message, "created_unix": e.created_unix,
        "started_unix": e.started_unix, "finished_unix": e.finished_unix, "metrics": e.totals(), "roles": roles,
        "stragglers": sorted(names.get(n, n) for n in slow),
        "median_step_rate": _median(list(rates.values())),
    }


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def series(rows: list[tuple[float, int, str, dict[str, Any]]], start: float,
           max_points: int = MAX_POINTS, carry_s: float = CARRY_S) -> dict[str, list[list[float]]]:
    """Chart series from stored metric points, at most `max_points` each, time in s since `start`.

    loss: the mean over workers of each one's latest loss; samples_per_s: the sum over
    workers; steps: the global step; eval_accuracy, eval_loss and every other eval_<name>: every evaluation.
    A source's value counts towards a bucket for `carry_s` after its time (longer for rows already merged in SQL).
    """
    rows = sorted(rows, key=lambda r: r[0])
    out: dict[str, list[list[float]]] = {"loss": [], "samples_per_s": [], "steps": [], "eval_accuracy": []}
    if not rows:
        return out
    t0, t1 = rows[0][0], rows[-1][0]
    width = max(1.0, (t1 - t0) / max_points)
    carry = carry_s
    loss: dict[str, tuple[float, float]] = {}
    speed: dict[str, tuple[float, float]] = {}
    steps = 0
    seen_eval: set[float] = set()
    edge = t0 + width
    i = 0
    while i < len(rows):
        t, step, source, values = rows[i]
        if t <= edge:
            if _finite(values.get("loss")) and "/ps" not in source:
                loss[source] = (t, float(values["loss"]))
            if _finite(values.get("samples_per_s")):
                speed[source] = (t, float(values["samples_per_s"]))
            if "/ps" in source or "updates" in values:
                steps = max(steps, int(step))
            evals = {k: v for k, v in values.items() if k.startswith("eval_") and k != "eval_step"
                     and isinstance(v, (int, float)) and math.isfinite(v)}
            if evals and values.get("eval_step", t) not in seen_eval:
                seen_eval.add(values.get("eval_step", t))
                for k, v in evals.items():
                    out.setdefault(k, []).append([round(t - start, 3), float(v)])
            i += 1
            continue
        _bucket(out, edge - start, edge, loss, speed, steps, carry)
        edge += width
        if t > edge:  # skip an empty stretch in one go
            edge = t0 + math.ceil((t - t0) / width) * width
    _bucket(out, min(edge, t1) - start, edge, loss, speed, steps, carry)
    return out


def _bucket(out: dict[str, list[list[float]]], x: float, edge: float, loss: dict[str, tuple[float, float]],
            speed: dict[str, tuple[float, float]], steps: int, carry: float = CARRY_S) -> None:
    x = round(x, 3)
    fresh_loss = [v for t, v in loss.values() if edge - t <= carry]
    if fresh_loss:
        out["loss"].append([x, sum(fresh_loss) / len(fresh_loss)])
    fresh_speed = [v for t, v in speed.values() if edge - t <= carry]
    if fresh_speed:
        out["samples_per_s"].append([x, sum(fresh_speed)])
    out["steps"].append([x, float(steps)])


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _clean(v: Any) -> Any:
    """JSON for browsers: NaN and infinities (not JSON) become null."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(_clean(data), allow_nan=False).encode(), status=status,
                    content_type="application/json")
