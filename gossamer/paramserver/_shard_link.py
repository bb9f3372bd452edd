"""A shard client's link: its DEALER sockets to the shards, and requests sent and their replies collected."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any, Required, TypedDict, Unpack

import torch
import zmq

from gossamer.core.errors import ConfigError, ProtocolError, ShardError, UnavailableError
from gossamer.core.protocol import chunk_key
from gossamer.engine.shard_plan import ShardPlan
from gossamer.paramserver.push_credits import CreditAsker
from gossamer.paramserver.push_parts import FRAGMENT_BYTES, FragmentedPushes
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

logger = logging.getLogger("gossamer.paramserver.shard_client")  # one logger for the client, whichever part logs

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


class LinkOptions(TypedDict, total=False):
    """A shard client's link settings (`ShardClient`'s keyword arguments but its codecs'); unset ones take the default.

    `endpoints`: each shard's address; `chunks`: this client's chunks (default: all); `timeout_s`: how
    long a request waits for its replies (60); `context`: the ZMQ context (default: the link's own);
    `limits`: frame limits (default: sized for the largest shard's reply); `throttle`: a bandwidth cap;
    `curve`: connect with CurveZMQ (default: the keyring installed in this process, if any); `token`:
    the proof of `sender` the coordinator handed this worker; `epochs`: each shard's fencing epoch as
    the coordinator last said (replies from older epochs are ignored); `fragment_bytes`: an async dense
    push to a shard goes as fragments under this size (`push_parts.fragments`).
    """

    experiment: Required[str]
    sender: Required[str]
    plan: Required[ShardPlan]
    endpoints: Required[dict[int, str]]
    chunks: list[int] | None
    timeout_s: float
    context: zmq.Context | None
    limits: FrameLimits | None
    throttle: TokenBucket | None
    curve: CurveKeyring | None
    token: str
    epochs: dict[int, int] | None
    fragment_bytes: int


class ShardLink:
    """One sender's sockets to the shards owning its chunks, and the request/reply loop over them.

    A request to each shard goes first and the replies are collected after, so shards work in
    parallel. The loop follows failovers (`on_wait`, `set_endpoints`), asks again when a shard
    says "not here yet", backs off when one is busy, waits for a large push's GRANT, gathers a
    fragmented push's answers, and counts what went over the wire.
    """

    def __init__(self, **options: Unpack[LinkOptions]) -> None:
        experiment, sender, plan, endpoints = (options["experiment"], options["sender"], options["plan"],
                                               options["endpoints"])
        chunks, limits, context = options.get("chunks"), options.get("limits"), options.get("context")
        timeout_s = options.get("timeout_s", 60.0)
        if not sender:
            raise ConfigError("sender", "must be a non-empty string")
        if timeout_s <= 0:
            raise ConfigError("timeout_s", f"must be > 0, got {timeout_s!r}")
        self.experiment = experiment
        self.sender = sender
        self.token = options.get("token", "")
        self._epochs: dict[int, int] = dict(options.get("epochs") or {})
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
        self.applied: dict[int, dict[str, int]] = {}
        #: Shard -> the workers' optimizer steps at its last round (`ParamsMeta.steps`: a train function's sync).
        self.steps: dict[int, int] = {}
        self.plan = plan
        self.timeout_s = timeout_s
        indices = sorted(c.index for c in plan.chunks) if chunks is None else sorted(chunks)
        #: Shard -> this client's chunks on it.
        self.by_shard: dict[int, list[int]] = {}
        for idx in indices:
            if not 0 <= idx < len(plan.chunks):
                raise ConfigError("chunks", f"chunk {idx} is not in the plan")
            self.by_shard.setdefault(plan.chunks[idx].shard, []).append(idx)
        largest = max((sum(plan.chunks[i].numel for i in idxs) for idxs in self.by_shard.values()), default=0)
        if limits is None:
            # A reply carries this client's chunks of one shard: past 256 MB (a 100M-parameter
            # model on one shard) the default limit would refuse the shard's own PARAMS.
            default = FrameLimits()
            limits = FrameLimits.for_values(largest) if 4 * 4 * largest > default.max_message_bytes else default
        self.limits = limits
        if missing := sorted(set(self.by_shard) - set(endpoints)):
            raise ConfigError("endpoints", f"no endpoint for shards {missing}")
        self._endpoints = {s: endpoints[s] for s in self.by_shard}
        self.fragments = FragmentedPushes(options.get("fragment_bytes", FRAGMENT_BYTES))
        self._send_depth = queue_depth(self.limits) + self.fragments.most(4 * largest)
        self._own_context = context is None
        self._ctx = context if context is not None else zmq.Context()
        curve = options.get("curve")
        self.curve = curve if curve is not None else curve_keys.installed()
        self._watch: dict[int, HandshakeMonitor] = {}
        self._refused: dict[int, str] = {}  # why a shard refused our last socket (kept across retries)
        self._asked_again: dict[int, str] = {}  # the last "ask again" refusal of each shard (said at a timeout)
        self.handshake_retries = 0
        self.busy_retries = 0  # requests sent again after a RESOURCE_EXHAUSTED answer
        self.socks: dict[int, zmq.Socket] = {s: self.connect(s) for s in self._endpoints}
        self._rid = 0
        self.credits = CreditAsker()  # a large push waits for its shard's GRANT
        self.throttle = options.get("throttle")
        #: Whether a PUSH now carries plain values (no codec either way): only those go as fragments.
        self.dense_pushes: Callable[[], bool] = lambda: True
        #: The requests of a push sent and not collected yet: nothing else may go before it is.
        self.pending_push: dict[int, Message] | None = None
        # Called every poll slice while waiting for replies (e.g. to pick up new endpoints
        # after a failover); may raise to abandon the wait.
        self.on_wait: Callable[[], None] | None = None
        self.resent = 0
        self.raw_bytes_up = self.raw_bytes_down = self.bytes_up = self.bytes_down = 0
        self.messages = 0
        #: Seconds spent encoding pushes (codec and frames) and decoding replies (frames, pulled differences).
        self.encode_s = 0.0
        self.decode_s = 0.0

    @property
    def shards(self) -> list[int]:
        """The shards this client talks to."""
        return sorted(self.by_shard)

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
        for s in self.by_shard:
            new = endpoints.get(s)
            if new and new != self._endpoints[s]:
                log_ = f"shard {s} moved: {self._endpoints[s]} -> {new}"
                logger.info(log_)
                self._endpoints[s] = new
                self.reconnect(s)
                moved.append(s)
        return moved

    def close(self) -> None:
        for watch in self._watch.values():
            watch.close()
        self._watch.clear()
        for sock in self.socks.values():
            sock.close(linger=0)
        self.socks.clear()
        if self._own_context:
            self._ctx.term()

    # -- sockets ----------------------------------------------------------------------
    def connect(self, shard: int) -> zmq.Socket:
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

    def reconnect(self, shard: int) -> None:
        """A new socket to `shard` (a late reply on the old one can never be mistaken)."""
        watch = self._watch.pop(shard, None)
        if watch is not None:
            watch.close()
        self.socks[shard].close(linger=0)
        self.socks[shard] = self.connect(shard)

    # -- requests ---------------------------------------------------------------------
    def msg(self, op: str, shard: int, meta: dict[str, Any] | None = None,
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

    def request(self, reqs: dict[int, Message]) -> dict[int, Message]:
        return self.collect(self.send(reqs))

    def send_one(self, s: int, msg: Message) -> None:
        out = self.credits.to_send(s, msg)
        dense = out is msg and self.dense_pushes()
        for k, piece in enumerate(self.fragments.pieces(s, out, dense=dense)):
            t0 = time.perf_counter()
            frames = encode(piece)
            self.encode_s += time.perf_counter() - t0
            nbytes = frames_nbytes(frames)
            if self.throttle is not None:
                self.throttle.consume(nbytes)
            sock = self.socks[s]
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

    def send(self, reqs: dict[int, Message]) -> dict[int, Message]:
        if self.pending_push is not None:
            raise RuntimeError("a push is still in flight: wait() for it first")
        for s, msg in reqs.items():
            self.send_one(s, msg)
        return dict(reqs)

    def collect(self, reqs: dict[int, Message], timeout_s: float | None = None,
                until_sent: bool = False) -> dict[int, Message]:
        """Wait for the reply to every request in `reqs` (shard -> request); `until_sent`: only until
        each (a push that asked for a credit) is granted and sent.

        Polls in short slices: between them `on_wait` may move shards (failover), and a
        request to a moved shard is sent again to its new endpoint.
        """
        waiting = dict(reqs)
        self._asked_again = {s: why for s, why in self._asked_again.items() if s not in waiting}
        sent_to = {s: self.socks[s] for s in waiting}
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
                self.send_one(s, waiting[s])
            for s, msg in waiting.items():
                if self.socks[s] is sent_to[s] and time.monotonic() >= ask_again.get(s, float("inf")):
                    del ask_again[s]
                    self.send_one(s, msg)
                if self.socks[s] is not sent_to[s]:  # moved: ask the new endpoint
                    ask_again.pop(s, None)
                    self.send_one(s, msg)
                    sent_to[s] = self.socks[s]
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
                    self.reconnect(s)
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
                        self.send_one(s, waiting[s])
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
        applied = {"seed_applied": self.applied[s]} if s in self.applied else {}
        self.send_one(s, self.msg("SEED", s, {"seed_version": version, **applied},
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


def poll_ms(left_ms: int, resend_at: Iterable[float], now: float, slice_ms: int = 100) -> int:
    """How long a wait for replies polls: a slice (`slice_ms`) of what is `left_ms`, and no later than the
    first request to be sent again (`resend_at`, monotonic times): a shard that answered RESOURCE_EXHAUSTED
    or asked to be asked again sends nothing meanwhile, so a poll past that time only adds to the step."""
    wake = min(left_ms, slice_ms)
    for at in resend_at:
        wake = min(wake, max(0, math.ceil((at - now) * 1000)))
    return wake


def _handshake_trouble(link: ShardLink, shards: list[int]) -> str:
    """Why requests to `shards` got no reply, as far as the socket monitors know."""
    notes = []
    for s in shards:
        if s in link._asked_again:
            notes.append(f"shard {s} refused for now, asked again until the timeout: {link._asked_again[s]}")
            continue
        watch = link._watch.get(s)
        if watch is None:
            continue
        failure = watch.check()
        if not watch.succeeded and (failure is None or not watch.fatal) and s in link._refused:
            # The retry's socket saw less (or nothing yet): the refusal that caused it says why.
            failure = link._refused[s]
        if failure is not None:
            notes.append(f"shard {s} at {link._endpoints.get(s)} did not complete the ZMQ handshake: {failure}")
        elif watch.dropped:
            notes.append(f"shard {s} at {link._endpoints.get(s)} dropped the connection {watch.dropped} time(s): "
                         "it stopped, or refused a message over its size limit (MAXMSGSIZE)")
    return "; ".join(notes)


def _raise_errors(replies: dict[int, Message]) -> None:
    """Raise `ShardError` naming every shard that answered ERROR (and its code)."""
    errors = [f"shard {s}: {r.meta.get('error', '?')} ({r.meta.get('code', '?')})"
              for s, r in sorted(replies.items()) if r.op == "ERROR"]
    if errors:
        raise ShardError("; ".join(errors), {str(r.meta.get("code", "")) for r in replies.values() if r.op == "ERROR"})


def _redial_refused(link: ShardLink, waiting: dict[int, Message], retry_at: dict[int, float],
                    retried: set[int]) -> None:
    """A new socket, once a second, to each waited-on shard whose handshake libzmq gave up on."""
    now = time.monotonic()
    for s in waiting:
        watch = link._watch.get(s)
        if watch is None or watch.check() is None or not watch.fatal or now < retry_at.get(s, 0.0):
            continue
        # Refused key, CURVE on one side only: the shard may not have heard of this node yet.
        (logger.debug if s in retry_at else logger.warning)(
            "shard %d refused the handshake (%s); retrying every second", s, watch.failure)
        retry_at[s] = now + 1.0
        retried.add(s)
        link._refused[s] = watch.failure or ""
        link.handshake_retries += 1
        link.reconnect(s)
