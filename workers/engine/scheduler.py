"""Who is admitted to the running batch at the next step, who is paused for them, and whether backlog
rows sit out the step. Pure: no torch, no Redis, no clock.

Rules, in order:
- interactive rows before backlog rows, first come first served within a lane;
- at most `max_rows` rows are in memory at once (running, held and prefilling), and their slots span
  at most the cache's `positions` (workers/engine/slot_table.py: a row's slot holds its prompt and its
  own new tokens, its *need*, rounded up to `unit`; in the uniform grid every slot is the longest
  job's): a row once admitted never runs out of room mid-answer. `reserved_interactive` of the rows and
  `reserve_positions` of the positions are never taken by backlog rows, so a ticket that arrives while
  a long backlog batch runs is admitted at the next step instead of waiting for a backlog row to
  finish (with nothing in memory, one backlog row always may run);
- an interactive row that finds no free slot pauses the youngest backlog row (it goes back to waiting
  and is recomputed later): a ticket never waits for a backlog answer, except for the rows the
  backlog's share protects (below);
- backlog rows admitted at one step prefill at most `backlog_prefill_tokens` positions together
  (one row always may), so a ticket arriving mid-step waits for little prefill;
- no backlog row is admitted while an interactive row runs (a prefill stalls every running row for its
  length), and on the CPU backlog rows are held (skip decode steps) while one does and no ticket waits
  for a slot, except at the backlog's own steps (below);
- **the backlog's share** (`backlog_share`, MRC_ENGINE_BACKLOG_SHARE), of the rows and positions in
  memory and of the steps. Memory (`backlog_slots` rows, and that share of the positions): up to its
  share, the backlog's rows join running tickets and go before
  waiting ones at any step, and once admitted so (or paused `SHARE_PAUSES` times) are not paused for
  tickets and cost it nothing while tickets wait. Steps (deficit counting, `Share`): it earns that
  share of a step at every step it has work and spends a whole one at every step it moves; with a
  step's credit it is *due*: its held rows decode beside the tickets, fresh rows may join them past
  its share of the slots, and at least one of its rows goes before waiting tickets. Tickets still come
  first at every other step; with a share of 0 the backlog only gets what tickets leave;
- rows of a **group** (suspects: a delivery that died with them in hand, or the rows of a decode step
  that failed for no one row's memory) run only beside their own group, so a group that fails is
  split in two and the one row that breaks the model ends up failing alone. Nothing is admitted while
  a group runs, nor past it while it waits (the rows in memory drain, so it is never starved); a
  backlog group gives way to a ticket as a backlog row does, a group with a ticket pauses the backlog
  rows in memory (held ones too) once no other ticket runs.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

INTERACTIVE = "interactive"
# While the backlog has a share, a row within its share of the slots is paused for tickets at most
# this many times: every pause throws its tokens away, and a row paused at each ticket (one slot, a
# steady stream of tickets) never finished. After that it keeps its slot and a ticket that needs one
# waits for it (at the backlog's cost in steps, past its share of the slots).
SHARE_PAUSES = 1
_DUE = 1.0 - 1e-9  # one step's credit (a share such as 0.1 never sums to exactly 1.0 in floats)
# The most steps the backlog's free progress (no ticket paying for it) counts for: with one ticket
# client the backlog ran between tickets and took a quarter of each ticket's steps anyway (p50 0.36 s
# -> 0.72 s on the CPU, backlog no faster); it claims steps again after (16 + 1) / share steps stalled.
FREE_STEPS = 16.0


@dataclass(frozen=True)
class Limits:
    max_rows: int  # rows in memory at once (lowered for a while after an out-of-memory step)
    reserved_interactive: int = 1
    hold_backlog: bool = False  # backlog rows skip decode steps (cache kept) while tickets decode
    # Most prefill positions of backlog rows admitted at one step (one row always may): a ticket that
    # arrives during a step waits at most that much prefill, not a whole delivery's.
    backlog_prefill_tokens: int = 1 << 30
    # Share of the steps, while tickets are in, that belong to the backlog (0: none, strict priority).
    backlog_share: float = 0.0
    # Most prefill positions computed at one step, all lanes (`chunks`): a long prefill is cut in
    # chunks, so a ticket that arrives waits for at most one step's worth.
    prefill_tokens: int = 1 << 30
    # The cache's pool: positions the rows' slots may span at once, a slot being a row's need rounded
    # up to `unit` (the uniform grid: unit = a whole slot, so positions / unit slots).
    positions: int = 1 << 62
    unit: int = 1
    reserve_positions: int = 0  # of the positions, what backlog rows never take (room for tickets)


@dataclass(frozen=True)
class Candidate:
    row_id: str
    lane: str
    group: str | None = None  # runs only beside rows of the same group (suspects)
    prompt_tokens: int = 0  # positions its prefill computes
    pauses: int = 0  # times it was paused for a ticket
    turn: bool = False  # a backlog row admitted on the backlog's turn (its share), beside or before tickets
    need: int = 0  # positions its slot holds: its prompt and its own new tokens


@dataclass
class Plan:
    admit: list[str] = field(default_factory=list)  # in admission order
    pause: list[str] = field(default_factory=list)  # running rows to send back to waiting first
    drain: bool = False  # a group waits for the rows in memory to leave: nothing else was admitted
    turn: list[str] = field(default_factory=list)  # backlog rows admitted on the backlog's turn


@dataclass(frozen=True)
class Step:
    """One engine step as the backlog's share counts it (rows as candidates)."""

    admitted: Seq[Candidate]  # admitted at this step
    decoded: Seq[Candidate]  # in the step's decode (held rows are not)
    waiting: Seq[Candidate]  # after the step
    in_memory: Seq[Candidate]  # after the step: running and held
    drain: bool = False  # the step's plan waited for a group's drain


@dataclass
class Share:
    """The backlog's claim on the steps: deficit counting, as deficit round robin does it. Every step
    at which the backlog has work earns it `share` of a step (at most one step banked); every step at
    which it moves spends a whole one. A step it takes at the tickets' expense (`took_turn`) may leave
    it owing without bound (a row that keeps the only slot while tickets wait); a step it moves at no
    one's expense (no ticket in, or beside tickets that lose nothing by it) counts down to
    FREE_STEPS owed at most: a backlog that moves on its own between tickets claims none of theirs,
    and one that stops moving is due again within (FREE_STEPS + 1) / share steps. Due at one step's
    credit."""

    share: float
    credit: float = 0.0

    @property
    def due(self) -> bool:
        return self.share > 0 and self.credit >= _DUE

    def settle(self, step: Step, limits: Limits) -> None:
        if self.share <= 0 or not _backlog([*step.admitted, *step.decoded, *step.waiting, *step.in_memory]):
            self.credit = 0.0
            return
        earned = self.credit + self.share
        if step.drain:  # a group waiting for the rows in memory: owed its turn until it runs
            self.credit = min(1.0, earned)
        elif took_turn(step, limits):
            self.credit = min(1.0, earned - 1.0)
        elif _backlog([*step.admitted, *step.decoded]):
            self.credit = min(1.0, max(earned - 1.0, min(self.credit, -FREE_STEPS)))
        else:
            self.credit = min(1.0, earned)


def took_turn(step: Step, limits: Limits) -> bool:
    """Whether the backlog took this step at the tickets' expense: a backlog row admitted while tickets
    were in (its prefill stalls them); backlog rows decoding beside tickets where holding would have
    kept them out (no ticket waiting for a slot); or a ticket left waiting while the backlog holds more
    than its share of the slots."""
    if not _tickets([*step.admitted, *step.decoded, *step.waiting, *step.in_memory]):
        return False
    waits = _tickets(step.waiting)
    held_back = limits.hold_backlog and not waits and _backlog(step.decoded) and _tickets(step.decoded)
    backlog = [c for c in step.in_memory if c.lane != INTERACTIVE]
    over_share = waits and (
        len(backlog) > backlog_slots(limits) or span(backlog, limits) > backlog_positions(limits)
    )
    return _backlog(step.admitted) or held_back or over_share


def chunk_order(rows: Seq[Candidate], hold_backlog: bool = False) -> list[str]:
    """Which prefilling rows get the step's prefill budget, in order: tickets first, each lane in
    admission order; backlog rows none while `hold_backlog` (tickets decode, as held rows sit out)."""
    return [
        c.row_id
        for c in sorted(rows, key=lambda c: c.lane != INTERACTIVE)
        if not (hold_backlog and c.lane != INTERACTIVE)
    ]


def hold(running: Seq[Candidate], waiting: Seq[Candidate], limits: Limits, due: bool = False) -> bool:
    """Whether backlog rows sit out the next decode step, their cache kept: while a ticket decodes,
    where a step's cost grows with its rows (the CPU: rows x the model's work), so a ticket decodes as
    fast as alone; except at the backlog's due steps, and while a ticket waits for a slot: then the
    backlog rows keeping the slots must move to give them back (held, they kept them for ever). On a
    GPU a decode step is expected to be bound by reading the weights (extra rows nearly free;
    docs/benchmarks.md), and holding rows would only cost the backlog its steps. `running` and
    `waiting`: once this step's admissions are in."""
    return limits.hold_backlog and not due and _tickets(running) and not _tickets(waiting)


def admit(waiting: Seq[Candidate], running: Seq[Candidate], limits: Limits, due: bool = False) -> list[str]:
    """The ids to admit now, in admission order (without pausing anyone)."""
    return plan(waiting, running, limits, pause=False, due=due).admit


def plan(
    waiting: Seq[Candidate], running: Seq[Candidate], limits: Limits, pause: bool = True, due: bool = False
) -> Plan:
    """What to do at the next step. `running` is every row in memory (running and held), in admission
    order (the youngest last); `due`: the backlog has a step's credit (`Share`)."""
    result = Plan()
    kept = list(running)
    group = next((c.group for c in kept if c.group is not None), None)
    yielded = group is not None and _group_yields(group, waiting, kept, result, limits, pause)
    if group is not None and not yielded:
        _admit_members(group, waiting, kept, result, limits)  # more of it as slots free, nothing else
        return result
    backlog_rows = max(0, limits.max_rows - limits.reserved_interactive)
    prefill = 0  # backlog prefill positions admitted in this plan
    tickets_in = _tickets([*waiting, *kept])
    ordered, ahead = _order(waiting, kept, limits, due)
    if yielded:  # it gave way to a ticket: no backlog row, of it or not, takes the ticket's slot first
        ordered, ahead = sorted(ordered, key=lambda c: c.lane != INTERACTIVE), set()
    for candidate in ordered:
        if candidate.group is not None:
            _enter_group(candidate.group, waiting, kept, result, limits, pause)
            return result  # nothing past a waiting group: the rows in memory drain, it is never starved
        interactive = candidate.lane == INTERACTIVE
        # With nothing in memory one backlog row always may run, even when the reserve takes every slot
        # (a memory ceiling lowered to the reserve, or the reserve set to the slots): a ticket that
        # comes pauses it.
        # The backlog's turn, up to its share of the slots, may take any free slot (the reserve included:
        # with tickets in every other slot, it was never its turn).
        reserved = candidate.row_id not in ahead and (
            len(kept) >= backlog_rows or not _fits(kept, limits, candidate, limits.reserve_positions)
        )
        if not interactive and kept and (reserved or (_tickets(kept) and not _beside(candidate, ahead, due))):
            continue
        if not interactive and prefill and prefill + candidate.prompt_tokens > limits.backlog_prefill_tokens:
            continue
        if not _fits(kept, limits, candidate) and interactive and pause:
            _pause_for(kept, limits, result, candidate)
        if not _fits(kept, limits, candidate):
            continue
        result.admit.append(candidate.row_id)
        if candidate.row_id in ahead and tickets_in:
            result.turn.append(candidate.row_id)
        kept.append(candidate)
        prefill += 0 if interactive else candidate.prompt_tokens
    return result


def backlog_slots(limits: Limits) -> int:
    """The backlog's whole share of the rows (0 below one row: there its share is of the time, paid
    for in steps). The rows it holds within it keep their slots free of charge while tickets wait."""
    return int(limits.backlog_share * limits.max_rows)


def backlog_positions(limits: Limits) -> int:
    """The backlog's share of the cache's positions (its rows within it: within its share)."""
    return int(limits.backlog_share * min(limits.positions, 1 << 40))


def slot_span(candidate: Candidate, limits: Limits) -> int:
    """Positions the candidate's slot spans: its need rounded up to the unit (the table's rule)."""
    unit = max(1, limits.unit)
    return max(unit, -(-candidate.need // unit) * unit)


def span(rows: Seq[Candidate], limits: Limits) -> int:
    return sum(slot_span(c, limits) for c in rows)


def _protected_rows(limits: Limits) -> int:
    """The backlog rows its turn may put before waiting tickets, and that tickets may not pause once
    admitted on its turn or paused SHARE_PAUSES times: its share of the slots, at least one."""
    return max(1, backlog_slots(limits)) if limits.backlog_share > 0 else 0


def _order(
    waiting: Seq[Candidate], kept: list[Candidate], limits: Limits, due: bool
) -> tuple[list[Candidate], set[str]]:
    """Tickets first, except the backlog's rows up to its share of the slots: at any step up to its
    whole share, at its due steps up to at least one (a slot freed by a finished ticket then goes to
    it, not to the next ticket). The order, and the ids of the backlog rows put ahead."""
    tickets = [c for c in waiting if c.lane == INTERACTIVE]
    backlog = [c for c in waiting if c.lane != INTERACTIVE]
    share = _protected_rows(limits) if due else backlog_slots(limits)
    inside = [c for c in kept if c.lane != INTERACTIVE]
    ahead: list[Candidate] = []
    room = backlog_positions(limits) - span(inside, limits)
    for candidate in backlog[: max(0, share - len(inside))]:
        room -= slot_span(candidate, limits)
        if room < 0 and not (due and not ahead and not inside):  # its due turn: one row at least
            break
        ahead.append(candidate)
    return [*ahead, *tickets, *backlog[len(ahead) :]], {c.row_id for c in ahead}


def _group_yields(
    group: str, waiting: Seq[Candidate], kept: list[Candidate], result: Plan, limits: Limits, pause: bool
) -> bool:
    """A group in memory runs with nothing beside it: False (admit nothing else) while it runs, unless
    it is a backlog one and a ticket waits: then it gives way as a backlog row does (paused,
    recomputed; at most SHARE_PAUSES times while the backlog has a share)."""
    members = [c for c in kept if c.group == group]
    if (
        pause
        and not _tickets(members)
        and any(c.lane == INTERACTIVE and c.group != group for c in waiting)
        and all(_pausable(c, limits) for c in members)
    ):
        result.pause += [c.row_id for c in reversed(kept)]
        kept.clear()
        return True
    return False


def _enter_group(
    group: str, waiting: Seq[Candidate], kept: list[Candidate], result: Plan, limits: Limits, pause: bool
) -> None:
    """A waiting group runs once nothing else is in memory; one with a ticket pauses the backlog rows in
    memory (held ones too) once no other ticket runs, unless one of them may not be paused again.
    Rows this plan admitted before it (the backlog's turn) are not paused but left waiting: they hold
    no slot yet, and the group runs beside nothing."""
    if (
        pause
        and _tickets([c for c in waiting if c.group == group])
        and all(_pausable(c, limits) for c in kept)
    ):
        fresh = set(result.admit)
        result.admit = []
        result.turn = []
        result.pause += [c.row_id for c in reversed(kept) if c.row_id not in fresh]
        kept.clear()
    if kept:
        result.drain = True
        return
    _admit_members(group, waiting, kept, result, limits)


def _admit_members(
    group: str, waiting: Seq[Candidate], kept: list[Candidate], result: Plan, limits: Limits
) -> None:
    """The group's waiting members (tickets first), as many as there are slots: they run together, apart
    from everything else (the prefill bound is for tickets beside the backlog; none runs beside it)."""
    members = [c for c in waiting if c.group == group]
    for candidate in sorted(members, key=lambda c: c.lane != INTERACTIVE):
        if not _fits(kept, limits, candidate):
            return
        result.admit.append(candidate.row_id)
        kept.append(candidate)


def _fits(kept: list[Candidate], limits: Limits, candidate: Candidate, keep_free: int = 0) -> bool:
    """Room for the candidate: a row under `max_rows` and its slot's positions in the pool beside the
    rows in memory, `keep_free` positions left over (one row always runs)."""
    if not kept:
        return True
    room = limits.positions - keep_free - span(kept, limits)
    return len(kept) < limits.max_rows and slot_span(candidate, limits) <= room


def _beside(candidate: Candidate, ahead: set[str], due: bool) -> bool:
    """Whether a backlog row may join running tickets: within the backlog's share of the slots (put
    ahead); past it at its due steps, a row not paused before (one paused before would be paused at
    the next ticket and recomputed once more)."""
    return candidate.row_id in ahead or (due and candidate.pauses < SHARE_PAUSES)


def _pausable(candidate: Candidate, limits: Limits) -> bool:
    """A backlog row a ticket may pause: any, with no share; with one, a row neither admitted on the
    backlog's turn nor paused too often yet (past the backlog's share of the slots, any: _pause_for)."""
    if candidate.lane == INTERACTIVE:
        return False
    return limits.backlog_share <= 0 or (candidate.pauses < SHARE_PAUSES and not candidate.turn)


def _pause_for(kept: list[Candidate], limits: Limits, result: Plan, ticket: Candidate) -> None:
    """Pause the youngest backlog rows (never one admitted in this plan) until a ticket fits, or none
    if that would still not make room. A row paused too often already is kept while the backlog holds
    no more than its share of the slots (the oldest such rows): the backlog keeps what it is owed and
    no more, so tickets still get every other slot."""
    candidates = [c for c in reversed(kept) if c.lane != INTERACTIVE and c.row_id not in result.admit]
    backlog = sum(c.lane != INTERACTIVE for c in kept)
    trial = list(kept)
    chosen: list[Candidate] = []
    for victim in candidates:
        if _fits(trial, limits, ticket):
            break
        if not _pausable(victim, limits) and backlog <= _protected_rows(limits):
            continue
        trial.remove(victim)
        chosen.append(victim)
        backlog -= 1
    if not _fits(trial, limits, ticket):
        return
    for victim in chosen:
        kept.remove(victim)
        result.pause.append(victim.row_id)


def _tickets(rows: Seq[Candidate]) -> bool:
    return any(c.lane == INTERACTIVE for c in rows)


def _backlog(rows: Seq[Candidate]) -> bool:
    return any(c.lane != INTERACTIVE for c in rows)
