"""How long a shard client's wait for replies polls (`poll_ms`): never past a request it must send again."""

from __future__ import annotations

from gossamer.paramserver.shard_client import poll_ms


def test_a_poll_is_a_slice_of_what_is_left() -> None:
    assert poll_ms(5_000, (), now=10.0) == 100
    assert poll_ms(40, (), now=10.0) == 40
    assert poll_ms(0, (), now=10.0) == 0


def test_a_poll_wakes_for_the_first_request_to_send_again() -> None:
    # A shard answered RESOURCE_EXHAUSTED (resend in 4 ms) and another asked to be asked again in 200 ms:
    # nothing comes from either meanwhile, so the poll must end when the first one is due, not a slice later.
    assert poll_ms(5_000, (10.004, 10.2), now=10.0) == 4
    assert poll_ms(5_000, (10.2,), now=10.0) == 100
    assert poll_ms(5_000, (10.0305,), now=10.0) == 31  # rounded up: never wakes before it is due


def test_a_request_already_due_is_not_waited_for() -> None:
    assert poll_ms(5_000, (9.5,), now=10.0) == 0
