"""Who is admitted to the running batch at the next step, and who is paused for them. Pure: no
torch, no Redis, no clock.

Rules, in order:
- interactive rows before backlog rows, first come first served within a lane;
- at most `max_rows` rows are in memory at once (running and held), one per slot of the cache
  (workers/engine/kv.py: a slot holds any job to its longest, so a row once admitted never runs out
  of room mid-answer), and `reserved_interactive` of those slots are never taken by backlog rows, so a
  ticket that arrives while a long backlog batch runs is admitted at the next step instead of waiting
  for a backlog row to finish (with nothing in memory, one backlog row always may run);
- an interactive row that finds no free slot pauses the youngest backlog row (it goes back to waiting
  and is recomputed later): a ticket never waits for a backlog answer;
- backlog rows admitted at one step prefill at most `backlog_prefill_tokens` positions together
  (one row always may), so a ticket arriving mid-step waits for little prefill;
- no backlog row is admitted while an interactive row runs: a prefill stalls every running row for
  its length (a 1 MP photo's is several decode steps' worth), and a ticket's answer must not pay for
  the backlog's refills; backlog slots freed meanwhile are refilled once the tickets are done;
- a row marked `alone` (a suspect: its last delivery died with it) runs only with nothing beside it,
  and nothing is admitted while it runs, nor past it while it waits (the rows in memory drain, so it
  is never starved); a backlog suspect gives way to a ticket (paused), a ticket suspect pauses the
  backlog rows in memory (held ones too) once no other ticket runs.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

INTERACTIVE = "interactive"


@dataclass(frozen=True)
class Limits:
    max_rows: int  # slots: rows in memory at once (lowered for a while after an out-of-memory step)
    reserved_interactive: int = 1
    hold_backlog: bool = False  # backlog rows skip decode steps (cache kept) while tickets are in
    # Most prefill positions of backlog rows admitted at one step (one row always may): a ticket that
    # arrives during a step waits at most that much prefill, not a whole delivery's.
    backlog_prefill_tokens: int = 1 << 30


def hold(running: Seq[Candidate], waiting: Seq[Candidate], limits: Limits) -> bool:
    """Whether backlog rows sit out the next decode steps, their cache kept: while any ticket is in
    the engine, where a step's cost grows with its rows (the CPU: rows x the model's work), so a
    ticket decodes as fast as alone. On a GPU a decode step is expected to be bound by reading the
    weights (extra rows nearly free; not measured yet: docs/benchmarks.md), and holding rows would only
    cost the backlog its steps."""
    return limits.hold_backlog and any(c.lane == INTERACTIVE for c in (*running, *waiting))


@dataclass(frozen=True)
class Candidate:
    row_id: str
    lane: str
    alone: bool = False
    prompt_tokens: int = 0  # positions its prefill computes


@dataclass
class Plan:
    admit: list[str] = field(default_factory=list)  # in admission order
    pause: list[str] = field(default_factory=list)  # running rows to send back to waiting first


def admit(waiting: Seq[Candidate], running: Seq[Candidate], limits: Limits) -> list[str]:
    """The ids to admit now, in admission order (without pausing anyone)."""
    return plan(waiting, running, limits, pause=False).admit


def plan(waiting: Seq[Candidate], running: Seq[Candidate], limits: Limits, pause: bool = True) -> Plan:
    """What to do at the next step. `running` is in admission order (the youngest last)."""
    result = Plan()
    kept = list(running)
    if not _alone_running_yields(waiting, kept, result, pause):
        return result
    backlog_rows = max(0, limits.max_rows - limits.reserved_interactive)
    prefill = 0  # backlog prefill positions admitted in this plan
    ordered = [c for c in waiting if c.lane == INTERACTIVE] + [c for c in waiting if c.lane != INTERACTIVE]
    for candidate in ordered:
        if candidate.alone:
            _admit_alone(candidate, kept, result, pause)
            return result  # nothing past a waiting suspect: the rows in memory drain, it is never starved
        interactive = candidate.lane == INTERACTIVE
        # With nothing in memory one backlog row always may run, even when the reserve takes every slot
        # (a memory ceiling lowered to the reserve, or the reserve set to the slots): a ticket that
        # comes pauses it.
        if (
            not interactive
            and kept
            and (len(kept) >= backlog_rows or any(c.lane == INTERACTIVE for c in kept))
        ):
            continue
        if not interactive and prefill and prefill + candidate.prompt_tokens > limits.backlog_prefill_tokens:
            continue
        if not _fits(candidate, kept, limits) and interactive and pause:
            _pause_for(candidate, kept, limits, result)
        if not _fits(candidate, kept, limits):
            continue
        result.admit.append(candidate.row_id)
        kept.append(candidate)
        prefill += 0 if interactive else candidate.prompt_tokens
    return result


def _alone_running_yields(waiting: Seq[Candidate], kept: list[Candidate], result: Plan, pause: bool) -> bool:
    """A suspect runs with nothing beside it: False (admit nothing) while one runs, unless it is a
    backlog one and a ticket waits: then it gives way as any backlog row does (paused, recomputed)."""
    for row in [c for c in kept if c.alone]:
        if pause and row.lane != INTERACTIVE and any(c.lane == INTERACTIVE for c in waiting):
            kept.remove(row)
            result.pause.append(row.row_id)
        else:
            return False
    return True


def _admit_alone(candidate: Candidate, kept: list[Candidate], result: Plan, pause: bool) -> None:
    """A waiting suspect runs once nothing is kept; a ticket one pauses the backlog rows in memory
    (held ones too) once no other ticket runs."""
    if pause and candidate.lane == INTERACTIVE and all(c.lane != INTERACTIVE for c in kept):
        result.pause += [c.row_id for c in reversed(kept)]
        kept.clear()
    if not kept:
        result.admit.append(candidate.row_id)


def _fits(candidate: Candidate, kept: list[Candidate], limits: Limits) -> bool:
    """A free slot (every slot holds any job to its longest; one row always runs)."""
    return not kept or len(kept) < limits.max_rows


def _pause_for(candidate: Candidate, kept: list[Candidate], limits: Limits, result: Plan) -> None:
    """Pause the youngest running backlog rows (never one admitted in this plan) until it fits, or
    none if pausing every such row would still not make room."""
    pausable = [c for c in reversed(kept) if c.lane != INTERACTIVE and c.row_id not in result.admit]
    trial = list(kept)
    chosen: list[Candidate] = []
    for victim in pausable:
        if _fits(candidate, trial, limits):
            break
        trial.remove(victim)
        chosen.append(victim)
    if not _fits(candidate, trial, limits):
        return
    for victim in chosen:
        kept.remove(victim)
        result.pause.append(victim.row_id)
