"""The CHOCO update of compressed gossip: references both ends share, and differences against them."""

from __future__ import annotations

import torch

from gossamer.compression.codec_spec import parse_codec
from gossamer.training.gossip.differences import EXACT, References, value_mass


def _receiver_value(codec_spec: str, payload, ref_value: torch.Tensor | None, n: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """What the receiving I/O thread computes: its own codec instance, its own stored reference."""
    d = parse_codec(codec_spec).decode(payload, (n,), torch.float32)
    return d if ref_value is None else ref_value + d


def test_first_mass_goes_whole_then_differences_against_the_applied_value() -> None:
    codec = parse_codec("int8")
    refs = References()
    z = torch.randn(5000)
    payload, ref, value, spec = refs.encode(codec, z, "b")
    assert ref == -1 and spec == "int8"  # a first contact costs the codec's bytes
    receiver = _receiver_value("int8", payload, None, z.numel())
    assert torch.equal(receiver, value)  # bit-identical at both ends
    refs.applied("b", 7, value)
    z2 = z + 1e-3 * torch.randn(5000)
    payload2, ref2, value2, spec2 = refs.encode(codec, z2, "b")
    assert ref2 == 7 and spec2 == "int8"
    receiver2 = _receiver_value("int8", payload2, receiver, z.numel())
    assert torch.equal(receiver2, value2)
    assert torch.equal(value_mass(receiver2, 0.25), value_mass(value2, 0.25))
    # The error is the codec's on the difference (1e-3 scale), not on the values (1 scale).
    err_whole = float((value - z).abs().max())
    err_diff = float((value2 - z2).abs().max())
    assert err_diff < err_whole / 100


def test_the_newest_applied_mass_is_the_reference_and_a_refusal_drops_it() -> None:
    refs = References()
    a, b = torch.zeros(3), torch.ones(3)
    refs.applied("p", 5, b)
    refs.applied("p", 3, a)  # an older ACK settling late does not move the reference back
    assert refs.reference("p") == 5
    refs.refused("p")
    assert refs.reference("p") is None
    refs.applied("p", 9, a)
    refs.applied("q", 2, b)
    refs.keep_only({"q"})
    assert refs.reference("p") is None and refs.reference("q") == 2


def test_sender_keeps_exactly_what_it_did_not_send() -> None:
    codec = parse_codec("qsgd:16", seed=1)
    refs = References()
    w, share = 1.0, 0.5
    z = torch.randn(4096)
    for hid in range(5):
        payload, _, value, _ = refs.encode(codec, z, "n")
        d = value_mass(value, share * w)
        kept = z * w - d
        # Push-sum mass: what the sender keeps plus what it sent is its mass, to fp32 round-off.
        assert torch.allclose(kept + d, z * w, atol=1e-6)
        refs.applied("n", hid, value)
        z = z + 1e-2 * torch.randn(4096)


def test_a_neighbour_that_lost_its_reference_is_resynchronised_exactly_once() -> None:
    codec = parse_codec("int8")
    refs = References()
    z = torch.randn(5000)
    _, _, first, _ = refs.encode(codec, z, "b")
    refs.applied("b", 1, first)
    refs.refused("b")  # evicted at the receiver: NACKed
    payload, ref, value, spec = refs.encode(codec, z, "b")
    assert ref == -1 and spec == EXACT.spec == "none"
    assert torch.equal(value, z)  # no codec error put back between the two ends
    assert torch.equal(_receiver_value(spec, payload, None, z.numel()), value)
    refs.refused("b")  # that one was lost too: still exact
    assert refs.encode(codec, z, "b")[3] == "none"
    refs.applied("b", 3, value)
    z2 = z + 1e-3 * torch.randn(5000)
    _, ref2, _, spec2 = refs.encode(codec, z2, "b")
    assert (ref2, spec2) == (3, "int8")  # differences through the codec again
    refs.refused("c")
    refs.keep_only({"b"})  # a neighbour that left is not re-synchronised when it returns
    assert refs.encode(codec, z, "c")[3] == "int8"
