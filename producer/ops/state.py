"""The ops page's state (`GET /ops/state`, rendered by producer/ops/page.py): lanes, workers, backlog
runs and batches, the dead-letter list, errors, ticket latency and the day's usage, read from Redis
alone (no Prometheus, no Grafana) at a bounded cost per refresh, whatever the fleet's history:

- the lanes: shared/lane_metrics.py `lane_view` (an LLEN and an LINDEX per lane list, the in-flight
  hash scanned by pages of 500);
- the last 60 minutes' ops hashes (shared/ops_counts.py): one pipeline of 60 HGETALLs (jobs out per
  minute, failures by code, latency buckets, the depth sampled by the workers);
- the workers: the live ones from a sorted set of last beats, their heartbeats in one MGET;
- the 20 latest runs and batches: one ZREVRANGE, their records in one pipeline;
- the dead-letter list: LLEN and the 5 newest entries; today's usage: one HGETALL.

Counts, ids and error codes only: no prompt, answer or image of any job is read.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from shared import backlog_share, names, ops_counts, run_progress
from shared.lane_metrics import lane_view
from shared.settings import Settings

SPARK_MINUTES = 15
ERROR_MINUTES = 60
LATENCY_MINUTES = 5
RUNS_SHOWN = 20
DLQ_SHOWN = 5
LIVE_S = names.WORKER_SEEN_S
BEAT_LATE_S = 12  # a beat every 5 s: older than this, the worker is marked late


def collect(client: Any, settings: Settings, now: float | None = None) -> dict[str, Any]:
    """The ops page's state. `now` places the minutes, runs and day counted; the workers' beats are
    aged by Redis's clock, which timed them, whatever `now` says (`_workers`)."""
    now = time.time() if now is None else now
    minutes = ops_counts.read_minutes(client, ERROR_MINUTES, now)
    return {
        "generated_at": round(now, 3),
        "lanes": _lanes(client, settings, minutes[-SPARK_MINUTES - 1 :]),
        "workers": _workers(client),
        "runs": _runs(client, now),
        "dead_letter": _dead_letter(client),
        "errors_last_hour": _errors(minutes),
        "latency": _latency(minutes[-LATENCY_MINUTES:]),
        "usage_today": _usage_today(client, now),
    }


def _lanes(client: Any, settings: Settings, minutes: list[dict[str, int]]) -> dict[str, Any]:
    """Each lane now, and its jobs in and out per minute over the last SPARK_MINUTES (the current
    minute last, partial). In = out + the change of depth (queued + held), sampled each minute."""
    view = lane_view(client)
    out: dict[str, Any] = {}
    for lane in names.LANES:
        done = [m.get(f"out|{lane}|succeeded", 0) + m.get(f"out|{lane}|failed", 0) for m in minutes]
        queued = int(view[lane]["depth"])
        # Each minute's first depth sample, and for the current minute's end, the depth now.
        depth = [m.get(f"depth|{lane}") for m in minutes]
        ends = [*depth[1:], queued + int(view[lane]["in_flight"])]
        came = [
            None if a is None or b is None else max(0, done[i] + b - a)
            for i, (a, b) in enumerate(zip(depth, ends, strict=True))
        ]
        limit = settings.backlog_max_depth if lane == "backlog" else 0
        out[lane] = {
            "depth": queued,
            "in_flight": int(view[lane]["in_flight"]),
            "oldest_age_s": round(float(view[lane]["oldest_age_s"]), 1),
            "depth_limit": limit or None,
            "limit_used": round(queued / limit, 3) if limit else None,
            "out_per_min": done[1:],
            "in_per_min": came[1:],
        }
    held = backlog_share.held(client)
    out["backlog"]["held_by_key"] = held
    out["backlog"]["share_each"] = backlog_share.share_each(
        held, settings.backlog_max_depth, settings.backlog_key_shares
    )
    return out


def _workers(client: Any) -> list[dict[str, Any]]:
    """The workers seen in the last LIVE_S, each beat's age by Redis's clock, which wrote its time
    (workers/heartbeat.py): this host's clock and theirs may be minutes apart."""
    seen = names.workers_seen_key()
    seconds, micros = client.time()
    now = float(seconds) + float(micros) / 1e6
    client.zremrangebyscore(seen, "-inf", now - LIVE_S)
    seen_since = client.zrangebyscore(seen, now - LIVE_S, "+inf", withscores=True)
    members = [(str(key), float(at)) for key, at in seen_since]
    beats = client.mget([key for key, _at in members]) if members else []
    workers = []
    for (key, beat_at), raw in zip(members, beats, strict=True):
        name = key.removeprefix(names.worker_key(""))
        if not raw:  # its entry expired (15 s without a beat): dead, until the sorted set forgets it
            workers.append({"hostname": name, "dead": True})
            continue
        beat = _beat(raw)
        if beat is None:  # one unreadable heartbeat is shown as such, never a failed page
            workers.append({"hostname": name, "unreadable": True})
            continue
        beat.setdefault("hostname", name)
        age = max(0.0, now - beat_at)
        stuck = _number(beat.get("batch_in_progress_s")) > (_number(beat.get("stuck_after_s")) or 1e9)
        workers.append({**beat, "beat_age_s": round(age, 1), "late": age > BEAT_LATE_S, "stuck": stuck})
    return sorted(workers, key=lambda w: str(w.get("hostname")))


_BEAT_NUMBERS = ("engine_slots", "engine_rows_running", "engine_rows_held", "engine_rows_waiting",
                 "gpu_memory_allocated_bytes", "gpu_memory_total_bytes")  # fmt: skip


def _beat(raw: str) -> dict[str, Any] | None:
    """A heartbeat as the page reads it (numbers as numbers, lanes as a list of names), or None. A
    worker of another version, or anything else writing there, must not fail the page: NaN, Infinity
    and numbers past a float's range (1e400 reads as inf) make the beat unreadable, as they would make
    /ops/state's JSON (review, helper-62: 500s for every operator)."""
    try:
        beat = json.loads(raw, parse_constant=_refuse, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return None
    if not isinstance(beat, dict):
        return None
    for field in _BEAT_NUMBERS:
        if field in beat:
            beat[field] = _count(beat[field])
    if "gpu_memory_total_bytes" in beat or "gpu_memory_allocated_bytes" in beat:  # the page shows both
        beat.setdefault("gpu_memory_total_bytes", 0)
        beat.setdefault("gpu_memory_allocated_bytes", 0)
    lanes = beat.get("lanes")
    beat["lanes"] = [str(lane) for lane in lanes] if isinstance(lanes, list) else []
    return beat


def _refuse(constant: str) -> float:
    raise ValueError(f"{constant} is no JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is past a float's range")
    return value


def _number(value: object) -> float:
    """Whatever a record holds, as a finite number: 0 where it is none ("nan", "1e400", a list)."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # a JSON integer of 400 digits is past a float
        return 0.0
    return number if math.isfinite(number) else 0.0


def _count(value: object) -> int:
    return int(_number(value))


def _runs(client: Any, now: float) -> dict[str, Any]:
    ids = [str(r) for r in client.zrevrange(names.runs_recent_key(), 0, RUNS_SHOWN - 1)]
    with client.pipeline(transaction=False) as pipe:
        for run_id in ids:
            pipe.hgetall(names.run_record_key(run_id))
        records = pipe.execute() if ids else []
    running: list[dict[str, Any]] = []
    finished: list[dict[str, Any]] = []
    for run_id, record in zip(ids, records, strict=True):
        if not record:
            continue
        row = _run_row(run_id, dict(record), now)
        (running if row["active"] else finished).append(row)
    return {"running": running, "finished": finished}


def _run_row(run_id: str, record: dict[str, str], now: float) -> dict[str, Any]:
    valid = _count(record.get("valid"))
    succeeded, failed = _count(record.get("finished_succeeded")), _count(record.get("finished_failed"))
    done = succeeded + failed
    state = record.get("state", "")
    remaining = run_progress.remaining(record)
    elapsed = max(1.0, now - run_progress.started(record))
    rate = done / elapsed
    if state == "enqueued" and not remaining:
        state = "done"
    return {
        "run_id": run_id,
        "kind": run_progress.kind(record),
        "state": state,
        "jobs": valid,
        "succeeded": succeeded,
        "failed": failed,
        "remaining": remaining,
        # the mean since it began: of a finished run, nothing (it would only fall as time passes)
        "rate_per_s": round(rate, 2) if remaining else None,
        "eta_s": round(remaining / rate) if rate > 0 and remaining else None,
        "active": run_progress.active(record),
    }


def _dead_letter(client: Any) -> dict[str, Any]:
    with client.pipeline(transaction=False) as pipe:
        pipe.llen(names.dead_letter_key())
        pipe.lrange(names.dead_letter_key(), 0, DLQ_SHOWN - 1)
        count, raw = pipe.execute()
    entries: list[dict[str, Any]] = []
    for text in raw:
        try:
            entry = json.loads(text)
        except (ValueError, RecursionError):
            entry = None
        if not isinstance(entry, dict):
            entries.append({"job_id": "?", "code": "unreadable"})
            continue
        # ids, codes and counts only: the entry's `job` (its prompt) and `message` stay out of the page
        entries.append({k: entry.get(k) for k in ("job_id", "code", "attempts", "at")})
    return {"count": int(count), "newest": entries, "command": "mrc dlq requeue"}


def _errors(minutes: list[dict[str, int]]) -> dict[str, int]:
    codes: dict[str, int] = {}
    for minute in minutes:
        for field, count in minute.items():
            if field.startswith("code|"):
                codes[field[5:]] = codes.get(field[5:], 0) + count
    return dict(sorted(codes.items(), key=lambda kv: -kv[1]))


def _latency(minutes: list[dict[str, int]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for lane in names.LANES:
        buckets: dict[str, int] = {}
        for minute in minutes:
            for field, count in minute.items():
                if field.startswith(f"lat|{lane}|"):
                    label = field.rsplit("|", 1)[1]
                    buckets[label] = buckets.get(label, 0) + count
        p50, p99 = ops_counts.quantile(buckets, 0.5), ops_counts.quantile(buckets, 0.99)
        out[lane] = {"jobs": sum(buckets.values()), "p50_le_s": _finite(p50), "p99_le_s": _finite(p99)}
    out["minutes"] = LATENCY_MINUTES
    return out


def _usage_today(client: Any, now: float) -> dict[str, dict[str, int]]:
    raw = client.hgetall(names.ops_day_key(ops_counts.day_of(now)))
    out: dict[str, dict[str, int]] = {}
    for field, value in raw.items():
        key, _, kind = str(field).rpartition("|")
        out.setdefault(key, {})[kind] = _count(value)
    return dict(sorted(out.items()))


def _finite(value: float | None) -> float | str | None:
    return "inf" if value is not None and value == float("inf") else value
