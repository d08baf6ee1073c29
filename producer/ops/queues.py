"""`mrc queues`: the ops view of the lanes and the workers, as JSON, as plain lines, or as rich tables
in a terminal."""

from __future__ import annotations

import json
import time
from typing import Any

from shared import backlog_share, names, redis_target
from shared import usage as usage_book
from shared.lane_metrics import lane_view
from shared.settings import Settings

THROUGHPUT_WINDOW_S = 300


def collect(client: Any, settings: Settings) -> dict[str, Any]:
    lanes = lane_view(client)
    held = backlog_share.held(client)
    hits, misses = (int(client.get(key) or 0) for key in names.cache_counter_keys())
    return {
        "lanes": {lane: int(lanes[lane]["depth"]) for lane in names.LANES},
        "in_flight": {lane: int(lanes[lane]["in_flight"]) for lane in names.LANES},
        "oldest_age_s": {lane: round(lanes[lane]["oldest_age_s"], 1) for lane in names.LANES},
        "done_per_min": _throughput(client),
        "rejected": int(client.llen(names.rejected_key())),
        "backlog_limit": settings.backlog_max_depth,
        # Each key's backlog jobs queued or running: what the lane's shares count (shared/backlog_share.py)
        "backlog_held_by_key": held,
        # Each key's share of the lane while several hold jobs in it (null: the depth limit alone)
        "backlog_share_each": backlog_share.share_each(
            held, settings.backlog_max_depth, settings.backlog_key_shares
        ),
        "dead_letter": int(client.llen(names.dead_letter_key())),
        "workers": _workers(client),
        "redis": redis_target.status(settings),
        "cache": {
            "hits": hits,
            "misses": misses,
            "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        },
        # Tokens of finished jobs per API key (`none`: submitted without one), fleet totals
        "usage_by_key": usage_book.totals(client),
    }


def _throughput(client: Any) -> dict[str, float]:
    """Jobs finished per minute and lane over the last five minutes, from the completion events."""
    since_ms = int((time.time() - THROUGHPUT_WINDOW_S) * 1000)
    counts = dict.fromkeys(names.LANES, 0)
    for _event_id, fields in client.xrange(names.events_key(), min=f"{since_ms}-0", max="+", count=200_000):
        lane = fields.get("lane")
        if lane in counts:
            counts[lane] += 1
    return {lane: round(count * 60 / THROUGHPUT_WINDOW_S, 1) for lane, count in counts.items()}


def _workers(client: Any) -> list[dict[str, Any]]:
    """Live workers: each refreshes its entry every 5 s, and it expires 15 s after the last beat."""
    out = []
    for key in sorted(client.scan_iter(match=names.worker_pattern(), count=100)):
        raw = client.get(key)
        if raw:
            out.append(dict(json.loads(raw)))
    return out


def _engine(w: dict[str, Any]) -> str:
    """The worker's engine: rows running / most rows, backlog rows held beside tickets, rows waiting,
    steps the backlog has not moved (a starving backlog shows here), the cache's positions (each row
    holds its need there) and the longest row's."""
    if "engine_slots" not in w:
        return "engine -"
    return (
        f"engine rows {w.get('engine_rows_running', '-')}/{w['engine_slots']} running, "
        f"{w.get('engine_rows_held', '-')} held, {w.get('engine_rows_waiting', '-')} waiting, "
        f"backlog stalled {w.get('engine_backlog_stalled_steps', '-')} steps, "
        f"cache of {w.get('engine_cache_positions', '-')} positions, "
        f"slots of {w.get('engine_slot_positions', '-')} positions at most"
    )


def _not_ready(w: dict[str, Any]) -> str:
    """ ", not ready: why" for a worker that says so (loading its model, or refusing readiness)."""
    return f", not ready: {w.get('not_ready_reason')}" if w.get("ready") is False else ""


def _worker_line(w: dict[str, Any]) -> str:
    return (
        f"worker {w.get('hostname')}{_not_ready(w)}: lanes {','.join(w.get('lanes', []))}, {w.get('model')} "
        f"{w.get('quantization')} on {w.get('device')}, {w.get('jobs')} jobs, "
        f"busy {w.get('busy_ratio')}, {_engine(w)}, buffered "
        f"{w.get('buffered', '-')}, batch in progress {w.get('batch_in_progress_s') or '-'} s, "
        f"attention {w.get('attention_backend', '-')}"
    )


def render_text(view: dict[str, Any]) -> str:
    lines = [
        f"{lane:<12} {depth}  in flight {view['in_flight'][lane]}, oldest waiting "
        f"{view['oldest_age_s'][lane]} s, done {view['done_per_min'][lane]}/min"
        for lane, depth in view["lanes"].items()
    ]
    lines.append(f"{'dead-letter':<12} {view['dead_letter']}")
    lines.append(f"{'rejected':<12} {view['rejected']}")
    lines.append(f"{'limit':<12} backlog {view['backlog_limit']}")  # MRC_BACKLOG_MAX_DEPTH (review)
    if view.get("backlog_held_by_key"):
        lines.append(f"{'held':<12} backlog {_held(view['backlog_held_by_key'])}{_shared(view)}")
    lines += [_worker_line(w) for w in view["workers"]]
    if "redis" in view:
        lines.append(_redis_line(view["redis"]))
    hits, misses, rate = view["cache"]["hits"], view["cache"]["misses"], view["cache"]["hit_rate"]
    lines.append(
        f"{'cache':<12} {hits} hits / {misses} misses" + (f" ({rate:.1%})" if rate is not None else "")
    )
    lines += [_usage_line(key, counts) for key, counts in view.get("usage_by_key", {}).items()]
    return "\n".join(lines)


def _held(held: dict[str, int]) -> str:
    """Each key's backlog jobs queued or running (`-`: jobs without a key)."""
    return ", ".join(f"key {key}: {count}" for key, count in held.items())


def _shared(view: dict[str, Any]) -> str:
    each = view.get("backlog_share_each")
    return "" if each is None else f" (shared: {each} each)"


def _usage_line(key: str, counts: dict[str, int]) -> str:
    return (
        f"{'usage':<12} key {key}: {counts.get('jobs', 0)} jobs, {counts.get('prompt_tokens', 0)} prompt "
        f"tokens ({counts.get('image_tokens', 0)} image), {counts.get('completion_tokens', 0)} completion"
    )


def _redis_line(redis: dict[str, Any]) -> str:
    if not redis.get("redis_sentinel"):
        return f"{'redis':<12} {redis['redis_master']}"
    return (
        f"{'redis':<12} master {redis['redis_master']} (Sentinel {redis['redis_sentinel_master']!r}, "
        f"{redis['redis_failovers']} failovers seen)"
    )


def render_rich(view: dict[str, Any], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    lanes = Table(title="lanes")
    for column in ("lane", "waiting", "in flight", "oldest waiting (s)", "done / min"):
        lanes.add_column(column, justify="left" if column == "lane" else "right")
    for lane, depth in view["lanes"].items():
        lanes.add_row(
            lane, str(depth), str(view["in_flight"][lane]), str(view["oldest_age_s"][lane]),
            str(view["done_per_min"][lane]),
        )  # fmt: skip
    workers = Table(title="workers")
    for column in (
        "worker",
        "lanes",
        "model",
        "device",
        "jobs",
        "busy",
        "buffered",
        "batch for (s)",
        "engine",
        "attention",
    ):
        workers.add_column(column)
    for w in view["workers"]:
        workers.add_row(
            str(w.get("hostname")) + _not_ready(w), ",".join(w.get("lanes", [])),
            f"{w.get('model')} {w.get('quantization')}",
            str(w.get("device")), str(w.get("jobs")), str(w.get("busy_ratio")), str(w.get("buffered", "-")),
            str(w.get("batch_in_progress_s") or "-"), _engine(w).removeprefix("engine "),
            str(w.get("attention_backend", "-")),
        )  # fmt: skip
    console = console or Console()
    console.print(lanes)
    console.print(workers)
    cache = view["cache"]
    console.print(
        f"dead letters {view['dead_letter']}, rejected entries {view['rejected']}, "
        f"cache {cache['hits']} hits / {cache['misses']} misses, backlog limit {view['backlog_limit']}"
    )
    if view.get("backlog_held_by_key"):
        shown = f"backlog held by {_held(view['backlog_held_by_key'])}{_shared(view)}"
        console.print(shown, markup=False, highlight=False)
    if "redis" in view:  # the master in use, as the plain lines say it (review: missing here)
        console.print(_redis_line(view["redis"]), markup=False, highlight=False)
    for key, counts in view.get("usage_by_key", {}).items():
        console.print(_usage_line(key, counts))
