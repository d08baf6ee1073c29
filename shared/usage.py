"""Token usage per API key: counted once per job when its result is written, kept in Redis as fleet
totals (one hash), read by `mrc queues --json`, mrc-api's /metrics and the lane exporter.

The worker's finisher counts a job's `usage` (shared/jobs.py) in one Lua step that also marks the
job's record (`usage_counted`) and keeps the numbers there (what `mrc backlog status` and a batch's
status sum per run): a result written twice (a redelivery after the worker died between the result
and the ack) is counted once. A record that expired (after 7 days) cannot be marked: such a late
rewrite would count again, which nothing in the normal flow does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared import names
from shared.scrape import ScrapeCache

NO_KEY = "none"  # the label of jobs submitted without an API key (mrc submit, mrc backlog, open API)
KINDS = ("prompt_tokens", "image_tokens", "completion_tokens", "total_tokens")
RECORD_FIELDS = ("usage_prompt", "usage_image", "usage_completion", "usage_cached", "usage_cached_tokens")

# KEYS[1] the job's record, KEYS[2] the totals hash, KEYS[3] this minute's ops hash, KEYS[4] today's
# (shared/ops_counts.py). ARGV: key label, prompt, image, completion, total tokens, cache hit (0/1),
# prompt positions reused from the engine's prefix cache; then the ops counts: lane ('' for none),
# status, error code, latency bucket, the two hashes' lifetimes, the run records' key prefix (a backlog
# job's run counts it finished; the one key not declared: mrc's Redis is never a cluster).
# Returns 1 when counted now, 0 when this job was counted before.
COUNT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HSETNX', KEYS[1], 'usage_counted', '1') == 0 then return 0 end
  redis.call('HSET', KEYS[1], 'usage_prompt', ARGV[2], 'usage_image', ARGV[3],
             'usage_completion', ARGV[4], 'usage_cached', ARGV[6], 'usage_cached_tokens', ARGV[7])
end
local key = ARGV[1]
redis.call('HINCRBY', KEYS[2], key .. '|jobs', 1)
redis.call('HINCRBY', KEYS[2], key .. '|prompt_tokens', ARGV[2])
redis.call('HINCRBY', KEYS[2], key .. '|image_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[2], key .. '|completion_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[2], key .. '|total_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[2], key .. '|cache_hits', ARGV[6])
if ARGV[8] ~= '' then
  redis.call('HINCRBY', KEYS[3], 'out|' .. ARGV[8] .. '|' .. ARGV[9], 1)
  if ARGV[10] ~= '' then redis.call('HINCRBY', KEYS[3], 'code|' .. ARGV[10], 1) end
  if ARGV[11] ~= '' then redis.call('HINCRBY', KEYS[3], 'lat|' .. ARGV[8] .. '|' .. ARGV[11], 1) end
  redis.call('EXPIRE', KEYS[3], ARGV[12])
  redis.call('HINCRBY', KEYS[4], key .. '|jobs', 1)
  redis.call('HINCRBY', KEYS[4], key .. '|prompt_tokens', ARGV[2])
  redis.call('HINCRBY', KEYS[4], key .. '|image_tokens', ARGV[3])
  redis.call('HINCRBY', KEYS[4], key .. '|completion_tokens', ARGV[4])
  redis.call('EXPIRE', KEYS[4], ARGV[13])
  local run = redis.call('HGET', KEYS[1], 'run_id')
  if run and run ~= '' and not redis.call('HGET', KEYS[1], 'run_counted') then
    redis.call('HINCRBY', ARGV[14] .. run, 'finished_' .. ARGV[9], 1)
    redis.call('HSET', KEYS[1], 'run_counted', ARGV[9])
  end
end
return 1
"""


# KEYS[1] a requeued job's record; ARGV[1] the run records' key prefix. Its run counted it finished
# (COUNT_SCRIPT, `run_counted`): not any more, until it finishes again.
UNCOUNT_RUN_SCRIPT = """
local run = redis.call('HGET', KEYS[1], 'run_id')
local was = redis.call('HGET', KEYS[1], 'run_counted')
if run and was then redis.call('HINCRBY', ARGV[1] .. run, 'finished_' .. was, -1) end
redis.call('HDEL', KEYS[1], 'run_counted')
return 1
"""


def count_args(api_key: str | None, usage: dict[str, int], cache_hit: bool) -> list[str | int]:
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return [
        api_key or NO_KEY,
        prompt,
        int(usage.get("image_tokens", 0)),
        completion,
        prompt + completion,
        1 if cache_hit else 0,
        int(usage.get("cached_tokens", 0)),
    ]


def totals(client: redis.Redis) -> dict[str, dict[str, int]]:
    """{key: {"jobs", "prompt_tokens", "image_tokens", "completion_tokens", "total_tokens",
    "cache_hits"}} over every job counted so far."""
    raw: dict[str, str] = client.hgetall(names.usage_totals_key())  # type: ignore[assignment]  # sync client
    out: dict[str, dict[str, int]] = {}
    for field, value in raw.items():
        key, _, kind = str(field).rpartition("|")
        out.setdefault(key, {})[kind] = int(value)
    return dict(sorted(out.items()))


def add_records(sums: dict[str, int], records: list[list[str | None]]) -> None:
    """Add job records' usage fields (RECORD_FIELDS, as HMGET returns them) to per-run sums."""
    for prompt, image, completion, cached, reused in records:
        if prompt is None:
            continue  # not finished, or finished before usage was kept
        p, c = int(prompt), int(completion or 0)
        sums["prompt_tokens"] = sums.get("prompt_tokens", 0) + p
        sums["image_tokens"] = sums.get("image_tokens", 0) + int(image or 0)
        sums["completion_tokens"] = sums.get("completion_tokens", 0) + c
        sums["total_tokens"] = sums.get("total_tokens", 0) + p + c
        # A reused answer's prompt is all cached; else what the engine's prefix cache held of it.
        cached_tokens = p if cached == "1" else int(reused or 0)
        sums["cached_prompt_tokens"] = sums.get("cached_prompt_tokens", 0) + cached_tokens


def empty_sums() -> dict[str, int]:
    return {kind: 0 for kind in (*KINDS, "cached_prompt_tokens")}


class UsageCollector(Collector):
    """`mrc_usage_tokens_total{api_key,kind}` and `mrc_usage_jobs_total{api_key}`: fleet totals read
    from Redis at scrape time (take max() across scraped processes, never sum(): each reads the same
    totals)."""

    def __init__(self, client: redis.Redis) -> None:
        self._view: ScrapeCache[dict[str, dict[str, int]]] = ScrapeCache(lambda: totals(client))

    def collect(self) -> Iterator[Any]:
        view = self._view.get()
        up = GaugeMetricFamily("mrc_usage_metrics_up", "1 when the usage totals could be read from Redis")
        up.add_metric([], 0.0 if view is None else 1.0)
        if view is not None:
            tokens = CounterMetricFamily(
                "mrc_usage_tokens", "Tokens of finished jobs per API key", labels=["api_key", "kind"]
            )
            jobs = CounterMetricFamily(
                "mrc_usage_jobs", "Finished jobs counted per API key", labels=["api_key"]
            )
            for key, counts in view.items():
                for kind in KINDS:
                    tokens.add_metric([key, kind.removesuffix("_tokens")], counts.get(kind, 0))
                jobs.add_metric([key], counts.get("jobs", 0))
            yield from (tokens, jobs)
        yield up
