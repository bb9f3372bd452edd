"""BudgetWaits: a current worker's requests over the reply budget wait in order, bounded in bytes and count."""

from __future__ import annotations

from gossamer.paramserver._budget_waits import BudgetWaits, Waiting
from gossamer.transport.frames import Message


def _waiting(rid: int, nbytes: int, since: float = 0.0) -> Waiting:
    return Waiting(Message(op="PUSH", experiment="e", meta={"rid": rid}), None, nbytes, since)


def test_requests_of_a_connection_wait_in_arrival_order_and_one_put_back_goes_first() -> None:
    waits = BudgetWaits(max_bytes=1000, max_count=8)
    first, second = _waiting(1, 10), _waiting(2, 10)
    waits.add(b"w", first)
    waits.add(b"w", second)
    assert waits.pop(b"w") is first
    waits.add(b"w", first, front=True)  # still over the budget: it waits on, before the later one
    assert [waits.pop(b"w"), waits.pop(b"w")] == [first, second]
    assert not waits and waits.waited == 2


def test_one_connection_never_takes_more_than_half_the_room_and_the_total_is_bounded() -> None:
    waits = BudgetWaits(max_bytes=1000, max_count=3)
    assert waits.may_add(b"a", 5000)  # one request always may wait alone, whatever its size
    waits.add(b"a", _waiting(1, 400))
    assert not waits.may_add(b"a", 200)  # past half the room for one connection
    assert waits.may_add(b"b", 500)
    waits.add(b"b", _waiting(2, 500))
    assert not waits.may_add(b"c", 200)  # past the room in all
    waits.add(b"c", _waiting(3, 10))
    assert not waits.may_add(b"d", 1)  # past the count


def test_a_request_has_waited_its_time_after_wait_s() -> None:
    waits = BudgetWaits(max_bytes=1000, max_count=8, wait_s=1.0)
    assert not waits.expired(10.0, 10.5)
    assert waits.expired(10.0, 11.0)
