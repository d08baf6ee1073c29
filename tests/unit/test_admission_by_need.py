"""Admission by positions (workers/engine/scheduler.py): a row's slot is its need, so the pool holds as
many rows as their needs allow, within `max_rows`; a ticket that does not fit pauses backlog rows
until its need does; backlog rows leave the tickets' reserve of positions alone. Pure: no torch."""

from __future__ import annotations

from workers.engine import scheduler
from workers.engine.scheduler import Candidate, Limits

LONGEST = 3376  # the longest job's slot (3,366 positions, rounded up to 16)


def _rows(prefix: str, count: int, lane: str = "backlog", need: int = 442) -> list[Candidate]:
    return [Candidate(f"{prefix}{i}", lane, prompt_tokens=need - 64, need=need) for i in range(count)]


def test_a_pool_of_eight_longest_slots_admits_the_rows_their_needs_fit() -> None:
    limits = Limits(max_rows=256, reserved_interactive=0, positions=8 * LONGEST, unit=16)
    plan = scheduler.plan(_rows("b", 100), [], limits)
    assert len(plan.admit) == 8 * LONGEST // 448 == 60  # 640x480 + 64 new tokens: 448 positions each
    uniform = Limits(max_rows=256, reserved_interactive=0, positions=8 * LONGEST, unit=LONGEST)
    assert len(scheduler.plan(_rows("b", 100), [], uniform).admit) == 8  # every slot the longest job's


def test_rows_stay_within_max_rows_whatever_the_pool_holds() -> None:
    limits = Limits(max_rows=16, reserved_interactive=0, positions=1 << 20, unit=16)
    assert len(scheduler.plan(_rows("b", 40), [], limits).admit) == 16


def test_a_ticket_pauses_backlog_rows_until_its_need_fits() -> None:
    limits = Limits(max_rows=64, reserved_interactive=0, positions=10 * 448, unit=16)
    in_memory = _rows("b", 10)  # the pool is full of small backlog rows
    ticket = Candidate("t", "interactive", prompt_tokens=2300, need=2400)  # a 12 MP photo
    plan = scheduler.plan([ticket], in_memory, limits)
    assert plan.admit == ["t"]
    assert plan.pause == ["b9", "b8", "b7", "b6", "b5", "b4"]  # 6 x 448 >= 2,400: the youngest first


def test_backlog_rows_leave_the_tickets_reserve_free() -> None:
    limits = Limits(
        max_rows=64, reserved_interactive=0, positions=20 * 448, unit=16, reserve_positions=5 * 448
    )
    plan = scheduler.plan(_rows("b", 30), [], limits)
    assert len(plan.admit) == 15
    tickets = _rows("t", 5, lane="interactive")
    admitted = [c for c in _rows("b", 30) if c.row_id in plan.admit]
    assert scheduler.plan(tickets, admitted, limits).admit == [t.row_id for t in tickets]  # no pause
