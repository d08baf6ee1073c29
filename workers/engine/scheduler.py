"""Who is admitted to the running batch at the next step. Pure: no torch, no Redis, no clock.

Rules, in order:
- interactive rows before backlog rows, first come first served within a lane;
- at most `max_rows` rows run at once, and `reserved_interactive` of those slots are never taken by
  backlog rows, so a ticket that arrives while a long backlog batch runs is admitted at the next step
  instead of waiting for a backlog row to finish;
- a row is admitted only if the cache can hold every running row at its longest plus this one
  (`kv_tokens`): a row once admitted never runs out of room mid-answer;
- a row too large for the cache even alone is admitted when nothing else runs (it fails or succeeds
  on its own, never for its neighbours).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_rows: int
    kv_tokens: int
    reserved_interactive: int = 1


@dataclass(frozen=True)
class Candidate:
    row_id: str
    lane: str
    reserved_tokens: int


def admit(waiting: Seq[Candidate], running: Seq[Candidate], limits: Limits) -> list[str]:
    """The ids to admit now, in admission order."""
    rows = len(running)
    used = sum(c.reserved_tokens for c in running)
    backlog_rows = max(0, limits.max_rows - limits.reserved_interactive)
    chosen: list[str] = []
    ordered = [c for c in waiting if c.lane == "interactive"] + [
        c for c in waiting if c.lane != "interactive"
    ]
    for candidate in ordered:
        if rows >= limits.max_rows:
            break
        if candidate.lane != "interactive" and rows >= backlog_rows:
            continue
        alone = rows == 0
        if used + candidate.reserved_tokens > limits.kv_tokens and not alone:
            continue
        chosen.append(candidate.row_id)
        rows += 1
        used += candidate.reserved_tokens
    return chosen
