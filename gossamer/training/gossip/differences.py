"""CHOCO-style compressed differences for push-sum: both ends keep the value of the last applied MASS."""

from __future__ import annotations

from collections import OrderedDict

import torch

from gossamer.compression.codec import Codec, Payload, all_finite
from gossamer.compression.float_codecs import NoneCodec
from gossamer.compression.wire_pool import WirePool

__all__ = ["EXACT", "REFS_PER_SENDER", "ReceivedValues", "References", "model_buffers", "value_mass"]

#: The codec of a whole MASS that re-synchronises a neighbour whose reference was lost: fp32 as
#: it is, so the re-sync leaves both ends on the exact value. Through the value codec, each
#: re-sync put the codec's whole error (relative 1e-2 for int8) back between the peers: under
#: lost ACKs, with MASSes sent faster than they were answered, int8 consensus hovered at 1e-5
#: to 2e-3 relative distance instead of falling below 1e-6.
EXACT = NoneCodec()

#: Values a receiver keeps per sender: a MASS may name any of the sender's last few applied
#: ones (ACKs still in flight when it was sent); an older reference is NACKed and the sender
#: sends its next MASS whole.
REFS_PER_SENDER = 4


def value_mass(value: torch.Tensor, weight: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The push-sum numerator of a MASS of `value` and `weight`: the one product both ends compute,
    so that sender and receiver hold bit-identical mass (into `out` where given)."""
    return torch.mul(value, weight, out=out)


def model_buffers(per_key: int) -> WirePool:
    """The pool one thread of a gossip peer takes its model-sized buffers from.

    A step sends and mixes several model-sized tensors (differences, decoded values, masses,
    sums). Freshly allocated, each is mmapped and faulted in page by page (role processes
    mmap allocations >= 1 MiB, `worker.allocator`): on the WAN bench half of a gossip
    worker's CPU time went to page faults and munmap. Taken from here, a buffer nothing
    references any more is written again; each key keeps at most `per_key` of them.

    Memory: the peak is what fresh buffers would reach (those live at once), but the pool
    keeps them between steps: as many per key as were ever live together, at most `per_key`.
    """
    return WirePool(per_key=per_key)


class References:
    """The sender's side of compressed differences (Koloskova et al. 2019, CHOCO-SGD).

    https://arxiv.org/abs/1902.00340 -- compressing the parameters themselves leaves every
    exchange an error proportional to the parameters, so push-sum with a value codec stops
    at the codec's relative precision (qsgd:127 at 6.2e-2). Sending ``C(z - v)`` against a
    value ``v`` both ends hold makes the error proportional to how far z moved since, which
    vanishes as the peers agree. Here ``v`` is the value of the last MASS to that neighbour
    that it applied (ACKed): the receiver keeps the values of the last `REFS_PER_SENDER`
    MASSes it applied from each sender, and both compute the new value as ``v + decode(c)``
    with the same fp32 arithmetic, so the references never drift apart. A MASS NACKed because
    the receiver no longer holds its reference (evicted, or a restarted receiver) drops that
    neighbour's reference: the next one goes whole (``ref`` -1), exactly (`EXACT`), until one
    is applied. The first MASS to a neighbour goes whole through the value codec: it costs a
    codec's bytes, not fp32's, and the differences after it take its error away. Other
    refusals (a lost MASS, another generation) leave the receiver's values as they were, and
    the reference stands. Mass stays exact as before: the sender keeps ``w z - weight * value``.
    """

    def __init__(self, buffers: WirePool | None = None) -> None:
        self._last: dict[str, tuple[int, torch.Tensor]] = {}
        self._resync: set[str] = set()  # neighbours that refused a reference and have applied none since
        self._buffers = buffers if buffers is not None else model_buffers(per_key=2)

    def encode(self, codec: Codec, z: torch.Tensor, to: str) -> tuple[Payload, int, torch.Tensor, str]:
        """(payload, ref id or -1, the value the receiver will decode, the payload's codec spec)
        for a MASS of `z` to `to`."""
        ref = self._last.get(to)
        n = z.numel()
        value = self._buffers.take("value", torch.float32, n)
        if ref is None:
            whole = EXACT if to in self._resync else codec
            payload = whole.encode(z, key="mass")
            return payload, -1, whole.decode(payload, (n,), torch.float32, out=value), whole.spec
        rid, base = ref
        diff = torch.sub(z.reshape(-1), base, out=self._buffers.take("difference", torch.float32, n))
        payload = codec.encode(diff, key="mass")
        del diff
        # decode(c) + v, as the receiver computes v + decode(c): the same fp32 sum, bit for bit.
        return payload, rid, codec.decode(payload, (n,), torch.float32, out=value).add_(base), codec.spec

    def applied(self, to: str, hid: int, value: torch.Tensor) -> None:
        """`to` applied MASS `hid` of `value`: the newest such becomes the reference."""
        last = self._last.get(to)
        if last is None or last[0] < hid:
            self._last[to] = (hid, value)
        self._resync.discard(to)

    def refused(self, to: str) -> None:
        """`to` no longer holds the reference (evicted, or a restarted peer): re-sync it exactly."""
        self._last.pop(to, None)
        self._resync.add(to)

    def keep_only(self, peers: set[str]) -> None:
        """Forget the references of neighbours that left or changed endpoint."""
        for peer in [p for p in self._last if p not in peers]:
            del self._last[peer]
        self._resync &= peers

    def reference(self, to: str) -> int | None:
        """The id of the MASS whose value the next difference to `to` is taken against."""
        last = self._last.get(to)
        return None if last is None else last[0]


class ReceivedValues:
    """The receiver's side: the values of the last `REFS_PER_SENDER` MASSes applied from each
    sender incarnation (at most `senders` of them, least recently heard from forgotten)."""

    def __init__(self, senders: int = 1024, buffers: WirePool | None = None) -> None:
        self._senders = senders
        self._by_sender: OrderedDict[tuple[str, int], OrderedDict[int, torch.Tensor]] = OrderedDict()
        self.buffers = buffers if buffers is not None else model_buffers(per_key=4 * REFS_PER_SENDER)

    def _values(self, sender: str, inc: int) -> OrderedDict[int, torch.Tensor]:
        key = (sender, inc)
        values = self._by_sender.get(key)
        if values is None:
            values = self._by_sender[key] = OrderedDict()
            while len(self._by_sender) > self._senders:
                self._by_sender.popitem(last=False)
        self._by_sender.move_to_end(key)
        return values

    def holds(self, sender: str, inc: int, ref: int) -> bool:
        """Whether a MASS with reference `ref` (-1: none) from this sender can be decoded."""
        return ref < 0 or ref in self._values(sender, inc)

    def mass(
        self, sender: str, inc: int, ref: int, hid: int, decoded: torch.Tensor, weight: float
    ) -> torch.Tensor | None:
        """The mass of MASS `hid` (its decoded payload plus its reference's value, times its
        weight), kept as a reference for later ones; None when it is not finite (not kept).
        `holds(sender, inc, ref)` must be true."""
        values = self._values(sender, inc)
        n = decoded.numel()
        value = decoded if ref < 0 else torch.add(values[ref], decoded,
                                                  out=self.buffers.take("value", torch.float32, n))
        d = value_mass(value, weight, out=self.buffers.take("mass", torch.float32, n))
        if not all_finite(d):
            return None
        values[hid] = value
        while len(values) > REFS_PER_SENDER:
            values.popitem(last=False)
        return d
