"""A backlog run's (or an OpenAI batch's) progress, read from its record in Redis: how many of its jobs
remain, whether it is still going, and the oldest one still going (the ops page and the lane metrics,
so that an alert can see a nightly run past its hours: review, helper-99)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from shared import names
from shared.jobs import parse_rfc3339

# Every run the ops page's list keeps (names.runs_recent_key: the last 1,000 started): with only the
# last 50, fifty small batches made after it hid a nightly run still going (review, helper-101).
RUNS_READ = 1000


def count(value: object) -> int:
    try:
        return max(0, int(str(value)))
    except ValueError:
        return 0


def remaining(record: Mapping[str, str]) -> int:
    done = count(record.get("finished_succeeded")) + count(record.get("finished_failed"))
    return max(0, count(record.get("valid")) - done)


def active(record: Mapping[str, str]) -> bool:
    """Still being queued, or queued with jobs not yet finished."""
    state = record.get("state", "")
    return state in ("enqueuing", "enqueued") and (remaining(record) > 0 or state == "enqueuing")


def kind(record: Mapping[str, str]) -> str:
    return "batch" if record.get("manifest", "").startswith("openai:") else "backlog"


def started(record: Mapping[str, str]) -> float:
    """Its creation time (epoch seconds; 0 when unreadable)."""
    try:
        return parse_rfc3339(str(record.get("created_at"))).timestamp()
    except ValueError:
        return 0.0


def oldest_active(client: Any, now: float | None = None) -> dict[str, dict[str, float]]:
    """Per kind (`backlog`, `batch`): the runs still going among the last RUNS_READ and the age of the
    oldest of them (0 when none)."""
    at = time.time() if now is None else now
    ids = [str(r) for r in client.zrevrange(names.runs_recent_key(), 0, RUNS_READ - 1)]
    with client.pipeline(transaction=False) as pipe:
        for run_id in ids:
            pipe.hgetall(names.run_record_key(run_id))
        records = pipe.execute() if ids else []
    out = {which: {"active": 0.0, "oldest_age_s": 0.0} for which in ("backlog", "batch")}
    for record in records:
        if record and active(record):
            row = out[kind(record)]
            row["active"] += 1
            if started(record) > 0:  # a record without its start still counts as going
                row["oldest_age_s"] = max(row["oldest_age_s"], at - started(record))
    return out
