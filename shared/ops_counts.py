"""What the ops page (producer/ops/state.py) reads besides the lanes and the heartbeats: jobs out per
minute and lane, failures by code, latency buckets, each key's tokens of the day, and the lanes'
depth sampled once a minute. Written where each thing happens, once: a finished job's counts in the
same Lua step that counts its usage (shared/usage.py COUNT_SCRIPT, once per job however often its
result is written), the depth by the workers' heartbeats (the first beat of a minute). Kept in one
Redis hash per minute (two hours) and one per day (three days): a refresh of the page reads a bounded
number of them, whatever the fleet's size or history.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

from shared import names

MINUTE_TTL_S = 2 * 3600
DAY_TTL_S = 3 * 86_400
# Upper bounds (seconds) of the latency buckets: a job's submission to its result.
BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, math.inf)


@dataclass(frozen=True)
class Finished:
    """A job that just got its result: what the minute's counts take from it."""

    lane: str
    status: str  # succeeded / failed
    code: str  # the error code of a failed job, else ''
    latency_s: float | None  # submission -> result, when both times are known


def minute_of(now: float) -> int:
    return int(now // 60)


def day_of(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


def bucket_of(seconds: float) -> str:
    """The label of the smallest bucket holding `seconds` ("inf" past the last bound)."""
    for bound in BUCKETS:
        if seconds <= bound:
            return "inf" if math.isinf(bound) else f"{bound:g}"
    return "inf"


def script_keys(now: float) -> list[str]:
    """COUNT_SCRIPT's KEYS[3] and KEYS[4]: this minute's hash and today's."""
    return [names.ops_minute_key(minute_of(now)), names.ops_day_key(day_of(now))]


def script_args(done: Finished | None) -> list[str | int]:
    """COUNT_SCRIPT's ARGV[8..]: lane ('' counts nothing here), status, code, latency bucket, the two
    hashes' lifetimes, the prefix of run records (a backlog job's run counts it as finished)."""
    if done is None:
        return ["", "", "", "", MINUTE_TTL_S, DAY_TTL_S, names.run_record_key("")]
    bucket = "" if done.latency_s is None else bucket_of(max(0.0, done.latency_s))
    return [done.lane, done.status, done.code, bucket, MINUTE_TTL_S, DAY_TTL_S, names.run_record_key("")]


def sample_depth(client: Any, now: float | None = None) -> None:
    """The lanes' depth (queued + held by workers) as the minute's first sample, unless another worker
    took it already (one command then)."""
    from shared.lane_metrics import lane_view

    key = names.ops_minute_key(minute_of(time.time() if now is None else now))
    if client.hexists(key, f"depth|{names.LANES[0]}"):
        return
    view = lane_view(client)
    depths = {lane: int(view[lane]["depth"] + view[lane]["in_flight"]) for lane in names.LANES}
    with client.pipeline(transaction=False) as pipe:
        for lane, depth in depths.items():
            pipe.hsetnx(key, f"depth|{lane}", depth)
        pipe.expire(key, MINUTE_TTL_S)
        pipe.execute()


def read_minutes(client: Any, count: int, now: float | None = None) -> list[dict[str, int]]:
    """The last `count` minutes' hashes, oldest first (the current minute last), in one round trip."""
    current = minute_of(time.time() if now is None else now)
    with client.pipeline(transaction=False) as pipe:
        for minute in range(current - count + 1, current + 1):
            pipe.hgetall(names.ops_minute_key(minute))
        replies = pipe.execute()
    # Counters (HINCRBY); a field that is not one (written by anything else) is left out, not a failure.
    return [{str(k): int(v) for k, v in (reply or {}).items() if _is_count(v)} for reply in replies]


_COUNT = re.compile(r"-?[0-9]{1,19}")


def _is_count(value: Any) -> bool:
    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return _COUNT.fullmatch(text) is not None


def quantile(counts: dict[str, int], q: float) -> float | None:
    """The bucket bound under which a share `q` of the counted jobs fall (None: none counted)."""
    total = sum(counts.values())
    if not total:
        return None
    seen = 0
    for bound in BUCKETS:
        label = "inf" if math.isinf(bound) else f"{bound:g}"
        seen += counts.get(label, 0)
        if seen >= q * total:
            return bound
    return math.inf
