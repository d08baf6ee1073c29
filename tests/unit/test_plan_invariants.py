"""What any plan of the scheduler must keep, whatever waits and whatever is in memory: drawn by
hypothesis over lanes, suspect groups, pauses, turns, slots, the reserve, hold and the share.

A plan that admitted a row and paused it in one go (a group entering after the backlog's turn) killed
a worker's engine thread; these are the rules the engine's bookkeeping relies on."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine import scheduler

LANES = st.sampled_from(["interactive", "backlog"])
GROUPS = st.sampled_from([None, None, "g1", "g2"])


@st.composite
def _candidates(draw: st.DrawFn, prefix: str, most: int) -> list[scheduler.Candidate]:
    count = draw(st.integers(0, most))
    found = []
    for i in range(count):
        lane, group, prompt = draw(LANES), draw(GROUPS), draw(st.integers(1, 3000))
        need = prompt + draw(st.integers(1, 600))
        found.append(
            scheduler.Candidate(
                f"{prefix}{i}", lane, group, prompt, draw(st.integers(0, 2)), draw(st.booleans()), need
            )
        )
    return found


@st.composite
def _limits(draw: st.DrawFn) -> scheduler.Limits:
    rows = draw(st.integers(1, 8))
    # The pool: unbounded (rows bind), or by need in units of 16 (a few long rows, or many short ones).
    positions = draw(st.sampled_from([1 << 62, 3616, 8000, 20000]))
    return scheduler.Limits(
        rows, draw(st.integers(0, rows)), draw(st.booleans()), draw(st.sampled_from([1 << 30, 500, 2000])),
        draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])), positions=positions, unit=16,
        reserve_positions=draw(st.sampled_from([0, 1616])) if positions < 1 << 62 else 0,
    )  # fmt: skip


@settings(max_examples=1500, deadline=None)
@given(_candidates("w", 5), _candidates("m", 5), _limits(), st.booleans())
def test_a_plan_admits_only_waiting_rows_pauses_only_rows_in_memory_and_keeps_groups_apart(
    waiting: list[scheduler.Candidate],
    in_memory: list[scheduler.Candidate],
    limits: scheduler.Limits,
    due: bool,
) -> None:
    # What is in memory is what a real engine could hold: within the rows and the pool, a group beside
    # nothing.
    in_memory = in_memory[: limits.max_rows]
    while len(in_memory) > 1 and scheduler.span(in_memory, limits) > limits.positions:
        in_memory.pop()
    groups = {c.group for c in in_memory}
    if len(groups) > 1 and groups != {None}:
        in_memory = [c for c in in_memory if c.group == next(g for g in groups if g is not None)]
    plan = scheduler.plan(waiting, in_memory, limits, due=due)
    waiting_ids, memory_ids = {c.row_id for c in waiting}, {c.row_id for c in in_memory}
    assert set(plan.admit) <= waiting_ids, plan
    assert len(plan.admit) == len(set(plan.admit)), plan
    assert set(plan.pause) <= memory_ids, plan
    assert len(plan.pause) == len(set(plan.pause)), plan
    assert set(plan.turn) <= set(plan.admit), plan
    after = [c for c in in_memory if c.row_id not in plan.pause]
    after += [c for c in waiting if c.row_id in plan.admit]
    assert len(after) <= max(1, limits.max_rows), plan
    if len(after) > 1:  # one row always may run; more only within the pool
        assert scheduler.span(after, limits) <= limits.positions, plan
    fresh_backlog = [c for c in waiting if c.row_id in plan.admit and c.lane != "interactive"]
    grouped = any(c.group is not None for c in after)  # a group runs beside nothing: no reserve to keep
    # The backlog's rows within its share may take any room, the reserve included (as its share of the
    # rows may take reserved rows); past its share, backlog rows leave the reserve alone.
    backlog_after = [c for c in after if c.lane != "interactive"]
    within_share = limits.backlog_share > 0 and len(backlog_after) <= max(
        scheduler.backlog_slots(limits), 1 if due else 0
    )
    if fresh_backlog and limits.reserve_positions and len(after) > 1 and not grouped and not within_share:
        assert scheduler.span(after, limits) <= limits.positions - limits.reserve_positions or any(
            c.lane == "interactive" for c in waiting if c.row_id in plan.admit
        ), f"backlog rows took the tickets' reserve: {plan}"
    assert not any(c.lane == "interactive" for c in in_memory if c.row_id in plan.pause), "a ticket paused"
    after_groups = {c.group for c in after}
    if any(g is not None for g in after_groups):
        assert len(after_groups) == 1, f"a group beside other rows: {plan}"
    if plan.drain:
        assert not any(c.group is not None for c in waiting if c.row_id in plan.admit), plan
