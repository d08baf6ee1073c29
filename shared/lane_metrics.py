"""Per-lane queue metrics read from Redis at scrape time: depth, in flight (taken by a worker, not
acked), and the age of the oldest waiting job; the backlog runs and batches still going and the age
of the oldest; and Redis's memory against its limit. Exported by every worker's /metrics and by `mrc
queues --serve-metrics PORT` (an exporter for autoscalers that needs no worker and no torch).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared import backlog_share, names, run_progress
from shared.jobs import parse_rfc3339
from shared.scrape import ScrapeCache


def lane_view(client: redis.Redis) -> dict[str, dict[str, float]]:
    """{lane: {"depth", "in_flight", "oldest_age_s"}} plus the dead-letter depth under "dead_letter"."""
    view: dict[str, dict[str, float]] = {}
    in_flight = _in_flight(client)
    now = datetime.now(UTC)
    for lane in names.LANES:
        keys = names.queue_keys(lane)
        depth = sum(int(client.llen(key)) for key in keys)
        oldest = None
        for key in keys:
            raw = client.lindex(key, -1)  # the tail is popped first: the oldest waiting message
            submitted = _submitted_at(raw) if raw else None
            if submitted is not None and (oldest is None or submitted < oldest):
                oldest = submitted
        age = (now - oldest).total_seconds() if oldest is not None and depth else 0.0
        view[lane] = {"depth": depth, "in_flight": in_flight.get(lane, 0), "oldest_age_s": max(0.0, age)}
    view["dead_letter"] = {"depth": int(client.llen(names.dead_letter_key()))}
    view["memory"] = _memory(client)
    return view


def _memory(client: redis.Redis) -> dict[str, float]:
    """Redis's memory in use and its `maxmemory` (0: none), from INFO; empty where INFO is not allowed
    (an ACL without it). Full under `noeviction`, Redis refuses every write while it still answers
    reads: mrc-api answers 503 to every new job while the lanes look well (review, helper-99)."""
    try:
        info = client.info("memory")
    except redis.ResponseError:
        return {}
    return {"used": float(info.get("used_memory", 0)), "max": float(info.get("maxmemory", 0))}


def _in_flight(client: redis.Redis) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _tag, raw in client.hscan_iter(names.UNACKED_KEY, count=500):
        try:
            routing_key = json.loads(raw)[2]
        except (ValueError, TypeError, IndexError, RecursionError):
            continue
        lane = str(routing_key).removeprefix("mrc.")
        counts[lane] = counts.get(lane, 0) + 1
    return counts


def _submitted_at(raw: bytes | str) -> datetime | None:
    """The job's submitted_at from a queued Celery message (body: base64 JSON [args, kwargs, embed])."""
    try:
        message = json.loads(raw)
        body = json.loads(base64.b64decode(message["body"]))
        return parse_rfc3339(str(body[1]["job"]["submitted_at"]))
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return None


_HELD_SEEN_MAX = 1_000  # keys whose mrc_backlog_held_jobs series stays at 0


class LaneCollector(Collector):
    def __init__(self, client: redis.Redis, runs: bool = False) -> None:
        """`runs`: the backlog runs' series too, read from every run record the ops page keeps (up to
        1,000): the lane exporter's (one process, or one beside each mrc-api replica as deploy/k8s
        runs it); every worker reading them at each scrape would cost the fleet that many reads a
        scrape."""
        self._view: ScrapeCache[dict[str, Any]] = ScrapeCache(
            lambda: {
                **lane_view(client),
                "runs": run_progress.oldest_active(client) if runs else None,
                "held": backlog_share.held(client) if runs else None,
                "rejected": int(client.get(names.rejected_count_key()) or 0),
            }
        )
        self._held_seen: set[str] = set()

    def _held_series(self, held: dict[str, int]) -> dict[str, int]:
        """Each key's held jobs, 0 for a key seen holding some since this exporter started: a series
        that vanished at 0 read as "no data" on a dashboard, and an alert on it never resolved (review,
        helper-103). Keys come from the operator's key list, so the remembered set stays small; it is
        capped all the same."""
        for owner in held:
            if len(self._held_seen) < _HELD_SEEN_MAX:
                self._held_seen.add(owner)
        return {owner: held.get(owner, 0) for owner in sorted(self._held_seen | set(held))}

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        view = self._view.get()
        depth = GaugeMetricFamily("mrc_queue_depth", "Jobs waiting on the lane", labels=["lane"])
        flight = GaugeMetricFamily(
            "mrc_queue_in_flight", "Jobs taken by a worker, not yet acked", labels=["lane"]
        )
        age = GaugeMetricFamily(
            "mrc_queue_oldest_age_seconds", "Age of the oldest waiting job (0 when none)", labels=["lane"]
        )
        dead = GaugeMetricFamily("mrc_dead_letter_depth", "Entries on the dead-letter list")
        rejected = CounterMetricFamily(
            "mrc_rejected", "Queue entries set aside as no message envelope (mrc:rejected keeps 1,000)"
        )
        used = GaugeMetricFamily("mrc_redis_memory_used_bytes", "Memory Redis uses (INFO used_memory)")
        most = GaugeMetricFamily("mrc_redis_memory_max_bytes", "Redis's maxmemory (0: no limit)")
        runs = GaugeMetricFamily(
            "mrc_backlog_runs_active", "Backlog runs and batches still going", labels=["kind"]
        )
        run_age = GaugeMetricFamily(
            "mrc_backlog_run_oldest_age_seconds",
            "Age of the oldest backlog run or batch still going (0 when none)",
            labels=["kind"],
        )
        held = GaugeMetricFamily(
            "mrc_backlog_held_jobs",
            "Backlog jobs queued or running, by the key holding them (`-`: none), for the lane's shares",
            labels=["key"],
        )
        up = GaugeMetricFamily("mrc_queue_metrics_up", "1 when the lane metrics could be read from Redis")
        up.add_metric([], 0.0 if view is None else 1.0)
        if view is not None:
            for lane in names.LANES:
                depth.add_metric([lane], view[lane]["depth"])
                flight.add_metric([lane], view[lane]["in_flight"])
                age.add_metric([lane], view[lane]["oldest_age_s"])
            dead.add_metric([], view["dead_letter"]["depth"])
            rejected.add_metric([], view["rejected"])
            yield from (depth, flight, age, dead, rejected)
            if view["runs"] is not None:
                for kind, row in view["runs"].items():
                    runs.add_metric([kind], row["active"])
                    run_age.add_metric([kind], row["oldest_age_s"])
                yield from (runs, run_age)
            if view["held"] is not None:
                for owner, count in self._held_series(view["held"]).items():
                    held.add_metric([owner], count)
                yield held
            if view["memory"]:
                used.add_metric([], view["memory"]["used"])
                most.add_metric([], view["memory"]["max"])
                yield from (used, most)
        yield up
