"""The Python client: submit experiments, follow them, list nodes (synchronous gRPC)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from gossamer.core.errors import AuthError, ConfigError, GossamerError, UnavailableError
from gossamer.core.experiment import Experiment
from gossamer.core.workdir import pack
from gossamer.security.channel import (
    ChannelSecurity,
    coordinator_addresses,
    explain_rpc_error,
    open_channel,
)
from gossamer.security.tls import TLSConfig
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

_STATE_NAMES: dict[int, str] = {
    pb.EXPERIMENT_STATE_QUEUED: "queued",
    pb.EXPERIMENT_STATE_STARTING: "starting",
    pb.EXPERIMENT_STATE_RUNNING: "running",
    pb.EXPERIMENT_STATE_COMPLETED: "completed",
    pb.EXPERIMENT_STATE_FAILED: "failed",
    pb.EXPERIMENT_STATE_CANCELLED: "cancelled",
}
_FINISHED = ("completed", "failed", "cancelled")


def state_name(state: int) -> str:
    return _STATE_NAMES.get(int(state), "unknown")


def _role_name(role: int) -> str:
    names: dict[int, str] = {pb.ROLE_PARAMETER_SERVER: "ps", pb.ROLE_WORKER: "worker"}
    return names.get(int(role), "")


def _node_state(state: int) -> str:
    return pb.NodeState.Name(pb.NodeState.ValueType(state)).removeprefix("NODE_STATE_").lower()


def status_dict(s: pb.ExperimentStatus) -> dict[str, Any]:
    """An ExperimentStatus as a plain dict (what `job.status()` returns)."""
    return {
        "id": s.id,
        "name": s.name,
        "state": state_name(s.state),
        "steps": s.steps,
        "total_steps": s.total_steps,
        "generation": s.generation,
        "message": s.message,
        "checkpoint": s.checkpoint,
        "created_unix": s.created_unix,
        "started_unix": s.started_unix,
        "finished_unix": s.finished_unix,
        "metrics": json.loads(s.metrics_json or "{}"),
        "roles": [
            {"node_id": r.node_id, "node": r.node_name, "role": _role_name(r.role), "index": r.index, "replica": r.replica,
             "endpoint": r.endpoint, "step_rate": r.step_rate, "straggler": r.straggler, "replicated": r.replicated}
            for r in s.roles
        ],
    }


def parse_role(role: str) -> tuple[pb.Role.ValueType, int]:
    """"worker/3" or "ps/0" ("" for none) as (Role, index); ConfigError names the field `role` otherwise."""
    if not role:
        return pb.ROLE_UNSPECIFIED, 0
    kind, _, index = role.partition("/")
    roles = {"worker": pb.ROLE_WORKER, "ps": pb.ROLE_PARAMETER_SERVER, "shard": pb.ROLE_PARAMETER_SERVER}
    if kind not in roles or not index.isdigit():
        raise ConfigError("role", f"expected worker/N or ps/N, got {role!r}")
    return roles[kind], int(index)


@dataclass(frozen=True)
class Shipped:
    """A code directory stored on the coordinator (`Client.upload_workdir`)."""

    digest: str
    size: int
    files: int
    already_stored: bool

    def __str__(self) -> str:
        again = ", stored before" if self.already_stored else ""
        return f"{self.files} files, {self.size / 1024:.1f} KiB packed, {self.digest[:19]}{again}"


@dataclass(frozen=True)
class Result:
    """The outcome of a finished experiment."""

    status: str
    checkpoint: str
    metrics: dict[str, float] = field(default_factory=dict)
    message: str = ""


class Job:
    """A submitted experiment."""

    def __init__(self, client: Client, experiment_id: str) -> None:
        self._client = client
        self.id = experiment_id

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def status(self) -> dict[str, Any]:
        """State, steps done, generation, roles, message and current totals."""
        return status_dict(self._client._call(self._client._exp.Get, pb.GetExperimentRequest(experiment_id=self.id)))

    def spec(self) -> dict[str, Any]:
        """The experiment's fields as the coordinator holds them (defaults filled in)."""
        resp = self._client._call(self._client._exp.Get, pb.GetExperimentRequest(experiment_id=self.id))
        return dict(json.loads(resp.experiment_json or "{}"))

    def metrics(self, since_unix: float = 0.0, max_points: int = 0) -> list[dict[str, Any]]:
        """The time series: one dict per point (time_unix, step, source, values...), oldest first.

        A range holding more than `max_points` points (0: the coordinator's default, 5000)
        comes merged per source into time buckets: each value is the bucket's mean, and
        "count", "min" and "max" (dicts by key) say what it stands for.
        """
        out: list[dict[str, Any]] = []
        token = ""
        while True:
            resp = self._client._call(self._client._exp.GetMetrics, pb.GetMetricsRequest(
                experiment_id=self.id, since_unix=since_unix, max_points=max_points, page_token=token))
            for p in resp.points:
                point: dict[str, Any] = {"time_unix": p.time_unix, "step": p.step, "source": p.source, **dict(p.values)}
                if p.count > 1:
                    point.update(count=p.count, min=dict(p.min_values), max=dict(p.max_values))
                out.append(point)
            token = resp.next_page_token
            if not token:
                return out

    def logs(self, role: str = "", *, local_rank: int | None = None, offset: int = 0, max_bytes: int = 0,
             node_id: str = "") -> dict[str, Any]:
        """A role's log and last traceback, read by the coordinator from the node that ran the role.

        Args:
            role: "worker/3" or "ps/0"; "": the role whose traceback is newest, else the newest log.
            local_rank: a worker's local rank (None: the one that failed, else rank 0).
            offset: log bytes already read (a follower passes the last answer's `end`); 0: the tail.
            max_bytes: at most this much log (0: 64 KiB, the most one answer holds).
            node_id: read from this node only (a follower pins the node of its first answer).

        Returns:
            node_id, node, role, index, local_rank, replica, text (the log piece, decoded with
            replacement), start, end, skipped (bytes left out before start), traceback,
            traceback_unix, modified_unix, available (every role log found), note.

        Raises:
            ConfigError: a malformed `role`.
            NotFoundError: unknown experiment, or no live node holds a log of the role.
        """
        kind, index = parse_role(role)
        req = pb.GetRoleLogRequest(experiment_id=self.id, role=kind, index=index, offset=offset,
                                   max_bytes=max_bytes, node_id=node_id)
        if local_rank is not None:
            req.local_rank = local_rank
        r = self._client._call(self._client._exp.GetRoleLog, req)
        return {"node_id": r.node_id, "node": r.node_name, "role": _role_name(r.role), "index": r.index,
                "local_rank": r.local_rank, "replica": r.replica, "text": r.text.decode("utf-8", "replace"),
                "start": r.start, "end": r.end, "skipped": r.skipped, "traceback": r.traceback,
                "traceback_unix": r.traceback_unix, "modified_unix": r.modified_unix,
                "available": list(r.available), "note": r.note}

    def events(self, since_unix: float = 0.0) -> list[dict[str, Any]]:
        """The coordinator's event log for this experiment: failures, detections, promotions,
        restores, discarded updates (dicts: time_unix, kind, message, node_id)."""
        resp = self._client._call(
            self._client._exp.ListEvents, pb.ListEventsRequest(experiment_id=self.id, since_unix=since_unix)
        )
        return [{"time_unix": e.time_unix, "kind": e.kind, "message": e.message, "node_id": e.node_id}
                for e in resp.events]

    def cancel(self) -> dict[str, Any]:
        return status_dict(self._client._call(self._client._exp.Cancel, pb.CancelExperimentRequest(experiment_id=self.id)))

    def watch(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield status dicts as the experiment changes, until it finishes (reconnects if needed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                stream = self._client._exp.Watch(
                    pb.WatchExperimentRequest(experiment_id=self.id),
                    timeout=None if deadline is None else max(0.1, deadline - time.monotonic()),
                )
                for s in stream:
                    d = status_dict(s)
                    yield d
                    if d["state"] in _FINISHED:
                        return
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise TimeoutError(f"experiment {self.id} not finished within {timeout} s") from None
                err = self._client._error(e)
                if not isinstance(err, UnavailableError):
                    raise err from None
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"experiment {self.id} not finished within {timeout} s")
            time.sleep(1.0)  # coordinator restarting: keep following

    def wait(self, timeout: float | None = None) -> Result:
        """Block until the experiment finishes; TimeoutError after `timeout` seconds."""
        last: dict[str, Any] = {}
        for status in self.watch(timeout=timeout):
            last = status
        return Result(
            status=last["state"], checkpoint=last["checkpoint"], metrics=last["metrics"], message=last["message"]
        )


_SUBMIT_TIMEOUT_S = 150.0
#: What gRPC says of a coordinator it reached that then dropped or stalled the connection (a slow handshake
#: on a loaded host, a closed socket): worth calling again within the timeout. A refused connection or an
#: unknown host is not, so a wrong address still fails at once.
_DROPPED = ("socket closed", "settings frame", "connection reset", "handshake", "ssl")


def _reached_but_dropped(e: grpc.RpcError, explained: GossamerError) -> bool:
    details = ((e.details() if hasattr(e, "details") else "") or "").lower()
    return isinstance(explained, UnavailableError) and any(m in details for m in _DROPPED)


class Client:
    """Talks to a coordinator at "host:port", or to whichever of several leads ("a:7070,b:7070" or a list).

    Args:
        address: coordinator address; several (docs/ha.md): calls go to the leader, and through a
            failover they wait for the next one (up to `timeout`) instead of failing.
        token: join/API token, sent as `authorization: Bearer` metadata on every call.
        tls: how to verify the coordinator: a CA bundle path (PEM), True for the system's roots,
            or a `TLSConfig` (CA, and a client certificate and key for mutual TLS).
        timeout: seconds per RPC.

    Raises:
        ConfigError: a certificate path does not exist or the token is malformed.
    """

    def __init__(self, address: str | Sequence[str], *, token: str | None = None,
                 tls: str | bool | TLSConfig | None = None, timeout: float = 30.0) -> None:
        addresses = coordinator_addresses(address)
        self.address = ",".join(addresses)
        self._follow = len(addresses) > 1  # several coordinators: wait out a change of leader
        self.timeout = timeout
        tls_config = tls if isinstance(tls, TLSConfig) else TLSConfig(ca=tls) if isinstance(tls, str) \
            else TLSConfig() if tls else None
        self.security = ChannelSecurity(tls=tls_config, token=token) if tls_config or token else None
        self._channel = open_channel(addresses, self.security)
        self._exp = pb_grpc.ExperimentServiceStub(self._channel)
        self._nodes = pb_grpc.NodeServiceStub(self._channel)
        self._ckpt = pb_grpc.CheckpointServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def secured(cls, address: str | Sequence[str], security: ChannelSecurity | None, timeout: float = 30.0) -> Client:
        """A client with the TLS settings and token of `security` (as the CLI flags build it)."""
        if security is None:
            return cls(address, timeout=timeout)
        return cls(address, token=security.token, tls=security.tls, timeout=timeout)

    def _error(self, err: grpc.RpcError) -> GossamerError:
        return explain_rpc_error(err, self.address, self.security)

    def _call(self, method: Any, request: Any, timeout: float | None = None, retry: bool = True) -> Any:
        """`method(request)`, called again (`retry`) within the timeout when that can help: with several
        coordinators, until a leader answers; with one, when it was reached but dropped the connection."""
        deadline = time.monotonic() + (timeout or self.timeout)
        ready = {"wait_for_ready": True} if self._follow else {}
        while True:
            try:
                return method(request, timeout=max(0.1, deadline - time.monotonic()), **ready)
            except grpc.RpcError as e:
                # With several coordinators, the error is explained (probing the port) only when raised.
                err = None if self._follow else self._error(e)
                again = e.code() == grpc.StatusCode.UNAVAILABLE if err is None else _reached_but_dropped(e, err)
                if not retry or not again or time.monotonic() >= deadline:
                    raise (err or self._error(e)) from None
            time.sleep(0.1 if self._follow else 0.2)

    def ping(self, timeout: float = 5.0) -> None:
        """Wait up to `timeout` s for the coordinator to answer.

        Raises:
            AuthError: TLS settings do not match the coordinator's (retrying will not help).
            UnavailableError: no answer in time.
        """
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        deadline = time.monotonic() + timeout
        while True:
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                return
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    return  # it answered (refusing is an answer too)
                err = self._error(e)
                if isinstance(err, AuthError):
                    raise err from None
                if time.monotonic() >= deadline:
                    raise UnavailableError(f"coordinator at {self.address} is unreachable") from None
            time.sleep(0.2)

    def upload_workdir(self, directory: str | os.PathLike[str]) -> Shipped:
        """Pack `directory` (skipping caches and version control: `gossamer.core.workdir.SKIPPED`) and
        store it on the coordinator, once per content; an Experiment's `workdir` then names it.

        Raises:
            ConfigError: not a directory, or (field workdir) over the coordinator's cap, naming the size.
        """
        packed = pack(directory)

        def pieces() -> Iterator[pb.WorkdirChunk]:
            for i, data in enumerate(packed.chunks()):
                yield pb.WorkdirChunk(digest=packed.digest, size=packed.size, data=data) if i == 0 \
                    else pb.WorkdirChunk(data=data)

        with packed.data:
            resp = self._call(self._exp.UploadWorkdir, pieces(), retry=False,
                              timeout=max(self.timeout, _SUBMIT_TIMEOUT_S))
        return Shipped(digest=resp.digest, size=resp.size, files=packed.files, already_stored=resp.already_stored)

    def submit(self, experiment: Experiment | dict[str, Any], *, workdir: str | os.PathLike[str] | None = None) -> Job:
        """Queue an experiment. ConfigError (naming the field) when the coordinator refuses it.

        `workdir`: a directory shipped with it (`upload_workdir`), first on the path of every role
        process and of the submit-time import check, so `model = "mymod:model"` may name a module
        that exists only there.
        """
        exp = experiment if isinstance(experiment, Experiment) else Experiment.from_dict(experiment)
        if workdir is not None:
            exp = dataclasses.replace(exp, workdir=self.upload_workdir(workdir).digest)
        # The coordinator imports the model and dataset in a child interpreter before it
        # accepts (up to 120 s); on a loaded machine that alone can outlast the RPC timeout.
        # Not called again on UNAVAILABLE: a leader lost after it queued the run would queue it twice.
        resp = self._call(self._exp.Submit, pb.SubmitRequest(experiment_json=exp.to_json()), retry=False,
                          timeout=max(self.timeout, _SUBMIT_TIMEOUT_S))
        return Job(self, resp.experiment_id)

    def job(self, experiment_id: str) -> Job:
        return Job(self, experiment_id)

    def experiments(self) -> list[dict[str, Any]]:
        return [status_dict(s) for s in self._call(self._exp.List, pb.ListExperimentsRequest()).experiments]

    def nodes(self) -> list[dict[str, Any]]:
        """Every known node: id, name, address, state, role, experiment, spot (and more)."""
        resp = self._call(self._nodes.ListNodes, pb.ListNodesRequest())
        return [
            {
                "id": n.id, "name": n.name, "address": n.address, "state": _node_state(n.state),
                "role": _role_name(n.role), "experiment": n.experiment_id, "spot": n.spot,
                "labels": dict(n.labels), "cpus": n.cpus, "gpus": n.gpus,
                "nproc_per_node": n.nproc_per_node, "lease_age_s": n.lease_age_s,
            }
            for n in resp.nodes
        ]


__all__ = ["Client", "GossamerError", "Job", "Result", "Shipped"]
