"""Worker side of the parameter server: push gradients and pull parameters over DEALER sockets."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.core.errors import ConfigError, ProtocolError, ShardError, UnavailableError
from gossamer.core.faults import die_at
from gossamer.core.protocol import (
    HelloMeta,
    ParamsMeta,
    PullMeta,
    PushCompression,
    PushMeta,
    chunk_key,
    parse_chunk_key,
)
from gossamer.engine.shard_plan import ShardPlan
from gossamer.paramserver.pulled_values import apply_deltas
from gossamer.paramserver.push_credits import CreditAsker
from gossamer.paramserver.push_parts import (
    FRAGMENT_BYTES,
    FragmentedPushes,
    push_rounds,
)
from gossamer.security import curve as curve_keys
from gossamer.security.curve import CurveKeyring, HandshakeMonitor
from gossamer.transport.frames import FrameLimits, Message, decode, encode, frames_nbytes
from gossamer.transport.router import (
    FENCED,
    NOT_A_WORKER,
    NOT_PRIMARY,
    RESOURCE_EXHAUSTED,
    SEEDING,
    configure_socket,
    queue_depth,
)
from gossamer.transport.throttle import TokenBucket

__all__ = ["PullResult", "ShardClient", "poll_ms"]

logger = logging.getLogger(__name__)

#: Refusals that say "not here yet": a backup the coordinator promoted that has not heard so
#: yet, a primary whose lease lapsed (renewed, or replaced by a promotion), a shard that has not
#: heard yet that this worker is one. Asked again this often.
_RETRY_CODES = (NOT_PRIMARY, FENCED, SEEDING, NOT_A_WORKER)
_RETRY_S = 0.2


def _poller_of(socks: Iterable[zmq.Socket]) -> zmq.Poller:
    """A poller for input on `socks`."""
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    return poller


@dataclass
class PullResult:
    """Parameters returned by a pull or push: chunk values by index, shard versions."""

    versions: dict[int, int]
    values: dict[int, torch.Tensor]
    done: bool
    staleness: dict[int, int] = field(default_factory=dict)


class ShardClient:
    """Talks to the shards owning `chunks` (default: all chunks) for one sender id.

    Several local ranks of one worker use the same `sender` with disjoint `chunks`; a shard
    applies the worker's update once it has every chunk. Requests to different shards are
    sent first and collected after, so shards work in parallel. Gradient tensors handed to
    `push_pull` are sent zero-copy; they are not read any more once it returns.
    """

    def __init__(
        self,
        *,
        experiment: str,
        sender: str,
        plan: ShardPlan,
        endpoints: dict[int, str],
        chunks: list[int] | None = None,
        timeout_s: float = 60.0,
        context: zmq.Context | None = None,
        limits: FrameLimits | None = None,
        throttle: TokenBucket | None = None,
        compressor: ChunkCompressor | None = None,
        pull_codec: str = "none",
        curve: CurveKeyring | None = None,
        token: str = "",
        epochs: dict[int, int] | None = None,
        shapes: Mapping[str, Sequence[int]] | None = None,
        fragment_bytes: int = FRAGMENT_BYTES,
    ) -> None:
        """`compressor` encodes pushed gradients; `pull_codec` asks shards for compressed parameter differences
        instead of full values (see ShardServer); `fragment_bytes`: an async dense push to a shard goes as fragments
        under this size (`push_parts.fragments`); `curve`: connect
        with CurveZMQ (default: the keyring installed in this process, if any); `token`: the
        proof of `sender` the coordinator handed this worker; `epochs`: each shard's fencing
        epoch as the coordinator last said (replies from older epochs are ignored); `shapes`: the
        parameters' shapes, for the pull decoder (default: the compressor's), as the shards know them."""
        if not sender:
            raise ConfigError("sender", "must be a non-empty string")
        if timeout_s <= 0:
            raise ConfigError("timeout_s", f"must be > 0, got {timeout_s!r}")
        self.experiment = experiment
        self.sender = sender
        self.token = token
        self._epochs: dict[int, int] = dict(epochs or {})
        self.stale_replies = 0  # replies from an older fencing epoch than this client knew, ignored
        self.retried = 0  # requests asked again after a NOT_PRIMARY or FENCED refusal
        #: (shard, epoch) -> the endpoint that answered for it: one primary per epoch, or `split_acks` counts it.
        self._answered_by: dict[tuple[int, int], str] = {}
        self.split_acks = 0
        #: Shard -> (the version this client last pulled, its copy of the values of its chunks of that
        #: shard): sent as a SEED to a shard rebuilt from its workers' copies (None: nothing to offer).
        self.seed_source: Callable[[int], tuple[int, dict[int, torch.Tensor]]] | None = None
        self._seeded: set[tuple[int, int]] = set()  # (shard, epoch) this client sent its copy to
        #: Shard -> every worker's applied clock in the values of its last answer (`ParamsMeta.applied`).
        self._applied: dict[int, dict[str, int]] = {}
        self.plan = plan
        self.timeout_s = timeout_s
        indices = sorted(c.index for c in plan.chunks) if chunks is None else sorted(chunks)
        self._by_shard: dict[int, list[int]] = {}
        for idx in indices:
            if not 0 <= idx < len(plan.chunks):
                raise ConfigError("chunks", f"chunk {idx} is not in the plan")
            self._by_shard.setdefault(plan.chunks[idx].shard, []).append(idx)
        largest = max((sum(plan.chunks[i].numel for i in idxs) for idxs in self._by_shard.values()), default=0)
        if limits is None:
            # A reply carries this client's chunks of one shard: past 256 MB (a 100M-parameter
            # model on one shard) the default limit would refuse the shard's own PARAMS.
            default = FrameLimits()
            limits = FrameLimits.for_values(largest) if 4 * 4 * largest > default.max_message_bytes else default
        self.limits = limits
        if missing := sorted(set(self._by_shard) - set(endpoints)):
            raise ConfigError("endpoints", f"no endpoint for shards {missing}")
        self._endpoints = {s: endpoints[s] for s in self._by_shard}
        self.fragments = FragmentedPushes(fragment_bytes)
        self._send_depth = queue_depth(self.limits) + self.fragments.most(4 * largest)
        self._own_context = context is None
        self._ctx = context if context is not None else zmq.Context()
        self.curve = curve if curve is not None else curve_keys.installed()
        self._watch: dict[int, HandshakeMonitor] = {}
        self._refused: dict[int, str] = {}  # why a shard refused our last socket (kept across retries)
        self._asked_again: dict[int, str] = {}  # the last "ask again" refusal of each shard (said at a timeout)
        self.handshake_retries = 0
        self.busy_retries = 0  # requests sent again after a RESOURCE_EXHAUSTED answer
        self._socks: dict[int, zmq.Socket] = {s: self._connect(s) for s in self._endpoints}
        self._rid = 0
        self.credits = CreditAsker()  # a large push waits for its shard's GRANT
        self.throttle = throttle
        self.compressor = compressor
        self.pull_codec = pull_codec
        #: Decodes the shards' compressed parameter differences (None without a pull codec).
        self.pull_decoder: ChunkCompressor | None = None
        if pull_codec != "none":
            self.pull_decoder = ChunkCompressor(pull_codec, plan, error_feedback=False, shapes=shapes if shapes is not None
                                                else compressor.shapes if compressor is not None else None)
        self._in_flight: dict[int, Message] | None = None
        # Called every poll slice while waiting for replies (e.g. to pick up new endpoints
        # after a failover); may raise to abandon the wait.
        self.on_wait: Callable[[], None] | None = None
        self.fault_ctx: dict[str, int] = {}  # worker/rank, for GOSSAMER_FAULT=die:at=mid-pull
        self.fault_step = 0
        self.resent = 0
        self._held: dict[int, torch.Tensor] = {}  # chunk values we hold (pull compression)
        self.raw_bytes_up = self.raw_bytes_down = self.bytes_up = self.bytes_down = 0
        self.messages = 0
        #: Seconds spent encoding pushes (codec and frames) and decoding replies (frames, pulled differences).
        self.encode_s = 0.0
        self.decode_s = 0.0

    @property
    def shards(self) -> list[int]:
        """The shards this client talks to."""
        return sorted(self._by_shard)

    def chunks_of_shard(self, shard: int) -> list[int]:
        return list(self._by_shard.get(shard, []))

    # -- API --------------------------------------------------------------------------
    def hello(self, fresh: bool = False) -> None:
        """Register this sender as an active worker on every involved shard.

        `fresh`: this is a new process under this sender id (its clocks start over).
        """
        self._request({s: self._msg("HELLO", s, HelloMeta(fresh=fresh).to_meta()) for s in self.shards})

    @property
    def endpoints(self) -> dict[int, str]:
        return dict(self._endpoints)

    def set_endpoints(self, endpoints: dict[int, str], epochs: dict[int, int] | None = None) -> list[int]:
        """Point shards at new endpoints (a promoted backup, a restored shard) of fencing `epochs`.

        A request waiting on a moved shard is sent again to the new endpoint; shards
        recognise a repeated push by its clock and do not apply it twice. Returns the
        shards that moved.
        """
        for s, epoch in (epochs or {}).items():
            self._epochs[s] = max(self._epochs.get(s, 0), epoch)
        moved = []
        for s in self._by_shard:
            new = endpoints.get(s)
            if new and new != self._endpoints[s]:
                log_ = f"shard {s} moved: {self._endpoints[s]} -> {new}"
                logger.info(log_)
                self._endpoints[s] = new
                self._reconnect(s)
                moved.append(s)
        return moved

    def pull(self, shards: Iterable[int] | None = None, timeout_s: float | None = None,
             chunks: Iterable[int] | None = None) -> PullResult:
        """Current values of this client's chunks (only of those on `shards`, if given, and of `chunks`, if given;
        `timeout_s`: not the default)."""
        only = None if chunks is None else set(chunks)
        reqs = {
            s: self._msg("PULL", s, PullMeta(chunks=tuple(i for i in self._by_shard[s] if only is None or i in only),
                                             pull_codec=self.pull_codec).to_meta())
            for s in (self.shards if shards is None else shards)
        }
        return self._result(self._collect(self._send(reqs), timeout_s))

    def _push_requests(
        self,
        grads: dict[int, torch.Tensor],
        *,
        clock: int,
        basis: dict[int, int],
        step: int | None = None,
        num_workers: int | None = None,
        generation: int | None = None,
        values: bool = True,
    ) -> dict[int, Message]:
        per_shard: dict[int, dict[str, torch.Tensor]] = {}
        for idx, g in grads.items():
            c = self.plan.chunks[idx]
            t = g.detach().reshape(-1)
            if t.dtype != torch.float32:
                t = t.float()
            per_shard.setdefault(c.shard, {})[chunk_key(idx)] = t
        reqs: dict[int, Message] = {}
        for s, tensors in per_shard.items():
            if s not in self._socks:
                raise ConfigError("grads", f"chunks of shard {s} are not this client's")
            meta = PushMeta(clock=clock, basis=basis.get(s, 0), pull_codec=self.pull_codec, step=step,
                            num_workers=num_workers, generation=generation, values=values).to_meta()
            self.raw_bytes_up += sum(4 * t.numel() for t in tensors.values())
            if self.compressor is not None:
                wire: dict[str, torch.Tensor] = {}
                chunk_meta: dict[str, Any] = {}
                for name, t in tensors.items():
                    idx = parse_chunk_key(name)
                    part, chunk_meta[str(idx)] = self.compressor.encode(idx, t)
                    wire.update(part)
                tensors = wire
                meta.update(PushCompression(chunks=chunk_meta, codec=self.compressor.default_spec,
                                            overrides=tuple(self.compressor.overrides)).to_meta())
            reqs[s] = self._msg("PUSH", s, meta, tensors)
        return reqs

    def push_pull(
        self,
        grads: dict[int, torch.Tensor],
        *,
        clock: int,
        basis: dict[int, int],
        step: int | None = None,
        num_workers: int | None = None,
        generation: int | None = None,
        consume: bool = False,
        values: bool = True,
    ) -> PullResult:
        """Push gradients (by chunk index) and return the new values of those chunks.

        `basis` maps shard -> the version the gradients were computed on; in sync mode pass
        `step` and `num_workers`. `consume` with a compressor: `grads` is emptied once encoded.
        `values` False: the shards answer with their versions and the end flag only (an ack), and
        the caller pulls the values (`pull` with `chunks`); a shard that predates the ack sends them.
        A large dense push under a barrier goes in parts, one at a time per shard (`push_parts`), and
        the values of those shards are pulled after the step.

        Raises:
            ShardError: a shard rejected the push (nothing of it was applied there).
            UnavailableError: a shard did not answer within `timeout_s`.
        """
        t0 = time.perf_counter()
        reqs = self._push_requests(grads, clock=clock, basis=basis, step=step, num_workers=num_workers,
                                   generation=generation, values=values)
        if consume and self.compressor is not None:
            grads.clear()  # encoded: a resend sends the payload, so the caller's buffers can go now
        self.encode_s += time.perf_counter() - t0
        parted: dict[int, list[int]] = {}
        if step is not None and self.compressor is None and self.pull_codec == "none":
            rounds, parted = push_rounds(reqs, lambda s, meta, tensors: self._msg("PUSH", s, meta, tensors))
            for batch in rounds[:-1]:  # each answered once in the step's sum
                self._collect(self._send(batch))
            reqs = rounds[-1]
        sent = self._send(reqs)
        die_at("mid-pull", step=self.fault_step, **self.fault_ctx)  # pushed, reply not read yet
        res = self._result(self._collect(sent))
        if values and parted:
            pulled = self.pull(list(parted), chunks=[i for chunks in parted.values() for i in chunks])
            res.values.update(pulled.values)
            res.versions.update(pulled.versions)
            res.done = res.done or pulled.done
        return res

    def push_async(self, grads: dict[int, torch.Tensor], *, clock: int, basis: dict[int, int]) -> None:
        """Send a push and return at once; `wait()` collects its reply (one in flight at most).

        The gradients are snapshotted, so the caller may overwrite its buffers right away.
        """
        t0 = time.perf_counter()
        snap = {i: g.detach().clone() for i, g in grads.items()}
        reqs = self._push_requests(snap, clock=clock, basis=basis)
        self.encode_s += time.perf_counter() - t0
        self._in_flight = self._send(reqs)
        asked = {s: m for s, m in reqs.items() if self.credits.asking(s)}
        if asked:  # a large push goes once granted: wait for that here, so it still travels behind compute
            try:
                self._collect(asked, until_sent=True)
            except BaseException:
                self._in_flight = None
                raise

    def wait(self) -> PullResult:
        """The reply to the push sent by `push_async`."""
        if self._in_flight is None:
            raise RuntimeError("no push in flight")
        waiting, self._in_flight = self._in_flight, None
        return self._result(self._collect(waiting))

    def abandon(self) -> None:
        """Forget the push in flight (its late reply is dropped by request id)."""
        self._in_flight = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def stats(self, shard: int) -> dict[str, Any]:
        """The STATS reply of `shard` (histogram keys as ints)."""
        if shard not in self._socks:
            self._socks[shard] = self._connect(shard)
        meta = dict(self._request({shard: self._msg("STATS", shard)})[shard].meta)
        meta.pop("rid", None)
        for key in ("staleness", "version_staleness"):
            meta[key] = {int(k): v for k, v in meta.get(key, {}).items()}
        return meta

    def probe(self, nbytes: int = 256 * 1024, repeats: int = 1) -> tuple[float, float]:
        """Measure the link to the first shard: (bare round trip s, round trip s with `nbytes`).

        Pairs of round trips through the same socket (and throttle) as pushes: a tiny STATS,
        then one carrying `nbytes` of padding; the least of `repeats` of each (a stall of
        either process only ever lengthens a trip). What the bytes cost is the padded trip
        minus the link's latency (`compression.adaptive.BaseLatency` keeps it from bare trips).
        """
        shard = self.shards[0]
        pad = torch.zeros(nbytes, dtype=torch.uint8)
        bare = padded = math.inf
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            self._request({shard: self._msg("STATS", shard)})
            t1 = time.perf_counter()
            self._request({shard: self._msg("STATS", shard, tensors={"probe": pad})})
            bare, padded = min(bare, t1 - t0), min(padded, time.perf_counter() - t1)
        return bare, padded

    def leave(self, timeout_s: float = 3.0) -> None:
        """Leave the active set of every involved shard (releases SSP waits on us).

        Best effort: a shard already gone (the job ended, its node left) is not waited on
        for longer than `timeout_s`.
        """
        try:
            self._collect(self._send({s: self._msg("LEAVE", s) for s in self.shards}), timeout_s)
        except UnavailableError as e:
            logger.info("LEAVE not answered (%s); the shards will drop us by membership", e)

    def close(self) -> None:
        for watch in self._watch.values():
            watch.close()
        self._watch.clear()
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
        if self._own_context:
            self._ctx.term()

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------
    def _connect(self, shard: int) -> zmq.Socket:
        endpoint = self._endpoints.get(shard)
        if endpoint is None:
            raise ConfigError("endpoints", f"no endpoint for shard {shard}")
        sock = self._ctx.socket(zmq.DEALER)
        configure_socket(sock, self.limits, send_depth=self._send_depth)
        if self.curve is not None:
            try:
                self.curve.secure_client(sock, endpoint)
            except Exception:
                sock.close(linger=0)
                raise
        # Always watched: a refused handshake (CURVE key, or CURVE on one side only) is
        # otherwise silence; the monitor costs nothing per message.
        old = self._watch.pop(shard, None)
        if old is not None:
            old.close()
        self._watch[shard] = HandshakeMonitor(sock)
        sock.connect(endpoint)
        return sock

    def _reconnect(self, shard: int) -> None:
        """A new socket to `shard` (a late reply on the old one can never be mistaken)."""
        watch = self._watch.pop(shard, None)
        if watch is not None:
            watch.close()
        self._socks[shard].close(linger=0)
        self._socks[shard] = self._connect(shard)

    def _msg(self, op: str, shard: int, meta: dict[str, Any] | None = None,
             tensors: dict[str, torch.Tensor] | None = None) -> Message:
        self._rid += 1
        auth = {"auth": self.token} if self.token else {}
        return Message(
            op=op,
            experiment=self.experiment,
            shard=shard,
            sender=self.sender,
            meta={**(meta or {}), **auth, "rid": self._rid},
            tensors=tensors or {},
        )

    def _request(self, reqs: dict[int, Message]) -> dict[int, Message]:
        return self._collect(self._send(reqs))

    def _send_one(self, s: int, msg: Message) -> None:
        out = self.credits.to_send(s, msg)
        dense = out is msg and self.compressor is None and self.pull_codec == "none"
        for k, piece in enumerate(self.fragments.pieces(s, out, dense=dense)):
            t0 = time.perf_counter()
            frames = encode(piece)
            self.encode_s += time.perf_counter() - t0
            nbytes = frames_nbytes(frames)
            if self.throttle is not None:
                self.throttle.consume(nbytes)
            sock = self._socks[s]
            try:
                # Never block: a DEALER whose only connection was refused at the handshake has no
                # pipe, and a blocking send there waited forever (a late-admitted CURVE key under
                # load). Unsent, the request is resent when the handshake watch reconnects, or
                # times out as unanswered. A later fragment has a pipe: it waits for room in it.
                if k and not sock.poll(int(self.timeout_s * 1000), zmq.POLLOUT):
                    raise zmq.Again()
                sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.debug("shard %d: no connection to send on yet; the request waits for a reconnect", s)
                return
            self.bytes_up += nbytes
            self.messages += 1

    def _send(self, reqs: dict[int, Message]) -> dict[int, Message]:
        if self._in_flight is not None:
            raise RuntimeError("a push is still in flight: wait() for it first")
        for s, msg in reqs.items():
            self._send_one(s, msg)
        return dict(reqs)

    def _collect(self, reqs: dict[int, Message], timeout_s: float | None = None,
                 until_sent: bool = False) -> dict[int, Message]:
        """Wait for the reply to every request in `reqs` (shard -> request); `until_sent`: only until
        each (a push that asked for a credit) is granted and sent.

        Polls in short slices: between them `on_wait` may move shards (failover), and a
        request to a moved shard is sent again to its new endpoint.
        """
        waiting = dict(reqs)
        self._asked_again = {s: why for s, why in self._asked_again.items() if s not in waiting}
        sent_to = {s: self._socks[s] for s in waiting}
        retry_at: dict[int, float] = {}
        retried: set[int] = set()  # reconnected after a refused handshake: resend, same deadline
        busy: dict[int, float] = {}  # answered RESOURCE_EXHAUSTED (nothing applied): send again then
        refusals: dict[int, int] = {}  # RESOURCE_EXHAUSTED answers to this request, by shard
        replies: dict[int, Message] = {}
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        ask_again: dict[int, float] = {}  # refused for now (NOT_PRIMARY, FENCED, an old epoch): when to resend
        poller, polled = zmq.Poller(), dict[zmq.Socket, int]()
        while waiting:
            if self.on_wait is not None:
                self.on_wait()
            for s in [s for s, at in busy.items() if time.monotonic() >= at]:
                del busy[s]
                self._send_one(s, waiting[s])
            for s, msg in waiting.items():
                if self._socks[s] is sent_to[s] and time.monotonic() >= ask_again.get(s, float("inf")):
                    del ask_again[s]
                    self._send_one(s, msg)
                if self._socks[s] is not sent_to[s]:  # moved: ask the new endpoint
                    ask_again.pop(s, None)
                    self._send_one(s, msg)
                    sent_to[s] = self._socks[s]
                    if s in retried:
                        retried.discard(s)
                    else:
                        self.resent += 1
                        deadline = time.monotonic() + timeout_s
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                lost = sorted(waiting)
                why = _handshake_trouble(self, lost)
                for s in lost:  # a late reply must not be read as the next request's
                    self._reconnect(s)
                raise UnavailableError(f"shards {lost} did not answer within {timeout_s:.1f}s"
                                       + (f": {why}" if why else ""))
            by_sock = {sent_to[s]: s for s in waiting}
            if polled != by_sock:  # a poller per socket set, not one per poll slice
                poller, polled = _poller_of(by_sock), by_sock
            ready = poller.poll(poll_ms(left_ms, (*busy.values(), *ask_again.values()), time.monotonic()))
            if not ready:
                _redial_refused(self, waiting, retry_at, retried)
            for sock, _ in ready:
                s = by_sock[sock]
                while s in waiting:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.bytes_down += frames_nbytes(frames)
                    t0 = time.perf_counter()
                    try:
                        reply = decode(frames, self.limits)
                    except ProtocolError as e:
                        raise ShardError(f"shard {s} sent an undecodable reply: {e}") from e
                    finally:
                        self.decode_s += time.perf_counter() - t0
                    if reply.meta.get("rid") != waiting[s].meta["rid"]:
                        logger.warning(
                            "dropped a stale reply from shard %d (rid %r)", s, reply.meta.get("rid")
                        )
                        continue
                    if reply.op == "ERROR" and reply.meta.get("code") == RESOURCE_EXHAUSTED:
                        # The shard holds its most in unread replies (its release can lag our read): back
                        # off, doubling per refusal of this request (a lifetime count grew to 1 s waits).
                        self.busy_retries += 1
                        refusals[s] = refusals.get(s, 0) + 1
                        busy[s] = time.monotonic() + min(1.0, 0.002 * 2 ** refusals[s])
                        break
                    if not self._current(s, reply):
                        ask_again[s] = time.monotonic() + _RETRY_S
                        break
                    if reply.op == "GRANT":  # the push may go now; its answer gets a whole timeout
                        self.credits.granted(s, reply.meta.get("rid"))
                        self._send_one(s, waiting[s])
                        deadline = time.monotonic() + timeout_s
                        if until_sent:
                            del waiting[s]
                        continue
                    if (whole := self.fragments.answer(s, reply)) is None:  # more fragments' answers to come
                        deadline = time.monotonic() + timeout_s
                        continue
                    reply = whole
                    self._note_answer(s, reply)
                    self._asked_again.pop(s, None)
                    replies[s] = reply
                    del waiting[s]
        _raise_errors(replies)
        return replies

    def _current(self, s: int, reply: Message) -> bool:
        """Whether `reply` answers for shard `s` now: False for one from an older fencing epoch than
        this client knows, and for a refusal that says to ask again (`_RETRY_CODES`)."""
        epoch = reply.meta.get("epoch", 0)
        if isinstance(epoch, int) and epoch < self._epochs.get(s, 0):
            self.stale_replies += 1
            logger.warning("shard %d answered from epoch %d, older than %d: ignored", s, epoch, self._epochs[s])
            return False
        if reply.op == "ERROR" and reply.meta.get("code") == SEEDING:
            self._send_seed(s, epoch if isinstance(epoch, int) else 0)
        if reply.op == "ERROR" and reply.meta.get("code") in _RETRY_CODES:
            self.retried += 1
            self._asked_again[s] = f"{reply.meta.get('error')} ({reply.meta.get('code')})"
            (logger.debug if self.retried % 50 else logger.info)(
                "shard %d: %s; asking again", s, reply.meta.get("error"))
            return False
        return True

    def _send_seed(self, s: int, epoch: int) -> None:
        """Offer shard `s` (rebuilt from its workers' copies) this client's copy of its chunks, once per epoch."""
        if self.seed_source is None or (s, epoch) in self._seeded:
            return
        self._seeded.add((s, epoch))
        version, values = self.seed_source(s)
        logger.warning("shard %d is rebuilt from its workers' copies: sending ours (version %d, %d chunks)", s,
                       version, len(values))
        applied = {"seed_applied": self._applied[s]} if s in self._applied else {}
        self._send_one(s, self._msg("SEED", s, {"seed_version": version, **applied},
                                    {chunk_key(i): v.reshape(-1).to(torch.float32) for i, v in values.items()}))

    def _note_answer(self, s: int, reply: Message) -> None:
        """Count a second endpoint answering for shard `s` in one fencing epoch (two primaries: a fencing bug)."""
        epoch = reply.meta.get("epoch")
        if reply.op == "ERROR" or not isinstance(epoch, int):
            return
        first = self._answered_by.setdefault((s, epoch), self._endpoints[s])
        if first != self._endpoints[s]:
            self.split_acks += 1
            logger.error("shard %d answered from %s and %s in one epoch (%d)", s, first, self._endpoints[s], epoch)

    def _result(self, replies: dict[int, Message]) -> PullResult:
        t0 = time.perf_counter()
        try:
            return self._values_of(replies)
        finally:
            self.decode_s += time.perf_counter() - t0

    def _values_of(self, replies: dict[int, Message]) -> PullResult:
        values: dict[int, torch.Tensor] = {}
        versions: dict[int, int] = {}
        staleness: dict[int, int] = {}
        done = False
        for s, reply in replies.items():
            try:
                meta = ParamsMeta.from_meta(reply.meta)
            except ProtocolError as e:
                raise ShardError(f"shard {s} sent a malformed reply: {e}") from e
            versions[s] = reply.version
            if meta.applied is not None:
                self._applied[s] = meta.applied
            done = done or meta.done
            if meta.staleness is not None:
                staleness[s] = meta.staleness
            compressed = meta.pull_compression
            for name, t in reply.tensors.items():
                if "/" not in name:
                    values[parse_chunk_key(name)] = t
            if compressed:
                values.update(apply_deltas(self.pull_decoder, self._held, s, reply, compressed))
            for idx in values:
                self.raw_bytes_down += 4 * self.plan.chunks[idx].numel
            if self.pull_decoder is not None:
                self._held.update(values)
        return PullResult(versions=versions, values=values, done=done, staleness=staleness)


def poll_ms(left_ms: int, resend_at: Iterable[float], now: float, slice_ms: int = 100) -> int:
    """How long a wait for replies polls: a slice (`slice_ms`) of what is `left_ms`, and no later than the
    first request to be sent again (`resend_at`, monotonic times): a shard that answered RESOURCE_EXHAUSTED
    or asked to be asked again sends nothing meanwhile, so a poll past that time only adds to the step."""
    wake = min(left_ms, slice_ms)
    for at in resend_at:
        wake = min(wake, max(0, math.ceil((at - now) * 1000)))
    return wake


def _handshake_trouble(client: ShardClient, shards: list[int]) -> str:
    """Why requests to `shards` got no reply, as far as the socket monitors know."""
    notes = []
    for s in shards:
        if s in client._asked_again:
            notes.append(f"shard {s} refused for now, asked again until the timeout: {client._asked_again[s]}")
            continue
        watch = client._watch.get(s)
        if watch is None:
            continue
        failure = watch.check()
        if not watch.succeeded and (failure is None or not watch.fatal) and s in client._refused:
            # The retry's socket saw less (or nothing yet): the refusal that caused it says why.
            failure = client._refused[s]
        if failure is not None:
            notes.append(f"shard {s} at {client._endpoints.get(s)} did not complete the ZMQ handshake: {failure}")
        elif watch.dropped:
            notes.append(f"shard {s} at {client._endpoints.get(s)} dropped the connection {watch.dropped} time(s): "
                         "it stopped, or refused a message over its size limit (MAXMSGSIZE)")
    return "; ".join(notes)


def _raise_errors(replies: dict[int, Message]) -> None:
    """Raise `ShardError` naming every shard that answered ERROR (and its code)."""
    errors = [f"shard {s}: {r.meta.get('error', '?')} ({r.meta.get('code', '?')})"
              for s, r in sorted(replies.items()) if r.op == "ERROR"]
    if errors:
        raise ShardError("; ".join(errors), {str(r.meta.get("code", "")) for r in replies.values() if r.op == "ERROR"})


def _redial_refused(client: ShardClient, waiting: dict[int, Message], retry_at: dict[int, float],
                    retried: set[int]) -> None:
    """A new socket, once a second, to each waited-on shard whose handshake libzmq gave up on."""
    now = time.monotonic()
    for s in waiting:
        watch = client._watch.get(s)
        if watch is None or watch.check() is None or not watch.fatal or now < retry_at.get(s, 0.0):
            continue
        # Refused key, CURVE on one side only: the shard may not have heard of this node yet.
        (logger.debug if s in retry_at else logger.warning)(
            "shard %d refused the handshake (%s); retrying every second", s, watch.failure)
        retry_at[s] = now + 1.0
        retried.add(s)
        client._refused[s] = watch.failure or ""
        client.handshake_retries += 1
        client._reconnect(s)
