"""The ops page's state (producer/ops/state.py): one refresh costs a bounded number of Redis commands,
the same at 100 workers and 20 runs shown as with ten times the dead letters and runs behind them, and
it carries counts, ids and codes, never a job's prompt."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from producer.ops import state
from scripts import devservices as services
from shared import names, ops_counts
from shared.settings import Settings

SECRET = "zebra-prompt-text"


@pytest.fixture
def client(tmp_path: Path) -> Iterator[redis.Redis]:
    server = services.start_redis(tmp_path / "redis")  # its own server: INFO commandstats counts only us
    connection = redis.Redis.from_url(server.url, decode_responses=True)
    yield connection
    connection.close()
    server.stop()


def _fleet(client: redis.Redis, workers: int, runs: int, dead: int, now: float) -> None:
    for i in range(workers):
        key = names.worker_key(f"w{i}")
        beat = {"hostname": f"w{i}", "lanes": ["interactive"], "seen_at": "2026-12-02T10:00:00Z"}
        client.set(key, json.dumps(beat), ex=60)
        client.zadd(names.workers_seen_key(), {key: now})
    for i in range(runs):
        client.hset(names.run_record_key(f"run{i}"), mapping={"state": "enqueued", "valid": 10})
        client.zadd(names.runs_recent_key(), {f"run{i}": now - i})
    for i in range(dead):
        entry = {"job_id": f"j{i}", "code": "out_of_memory", "attempts": 3, "job": {"prompt": SECRET}}
        client.lpush(names.dead_letter_key(), json.dumps(entry))
    for minute in range(60):
        key = names.ops_minute_key(ops_counts.minute_of(now) - minute)
        client.hset(
            key,
            mapping={"out|interactive|succeeded": 5, "code|image_decode_error": 1, "lat|interactive|0.5": 5},
        )


def _commands(client: redis.Redis) -> int:
    return sum(int(v["calls"]) for v in client.info("commandstats").values())


def _cost(client: redis.Redis, now: float) -> tuple[int, dict]:
    before = _commands(client)
    view = state.collect(client, Settings(), now)
    return _commands(client) - before - 1, view  # the second INFO is not the refresh's


def test_a_refresh_costs_a_bounded_number_of_commands_and_shows_no_prompt(client: redis.Redis) -> None:
    now = time.time()
    _fleet(client, workers=100, runs=20, dead=50, now=now)
    cost, view = _cost(client, now)
    print(f"one refresh at 100 workers and 20 runs: {cost} Redis commands")
    assert cost <= 120
    assert len(view["workers"]) == 100
    assert len(view["runs"]["running"]) == 20
    client.hset(names.run_record_key("run0"), mapping={"finished_succeeded": 10})  # run0 has ended
    ended = state.collect(client, Settings(), now)["runs"]["finished"][0]
    assert (ended["run_id"], ended["state"], ended["rate_per_s"], ended["eta_s"]) == (
        "run0",
        "done",
        None,
        None,
    )
    client.hdel(names.run_record_key("run0"), "finished_succeeded")
    assert view["dead_letter"]["count"] == 50
    assert view["errors_last_hour"] == {"image_decode_error": 60}
    assert view["latency"]["interactive"]["p50_le_s"] == 0.5
    assert SECRET not in json.dumps(view)
    _fleet(client, workers=0, runs=200, dead=5000, now=now)  # more behind what is shown: same cost
    assert _cost(client, now)[0] == cost


def test_jobs_in_per_minute_are_jobs_out_plus_the_change_of_depth(client: redis.Redis) -> None:
    now = 1_800_000_000.0
    minute = ops_counts.minute_of(now)
    client.hset(names.ops_minute_key(minute - 1), mapping={"depth|backlog": 10, "out|backlog|succeeded": 4})
    client.hset(names.ops_minute_key(minute), mapping={"depth|backlog": 16})
    lanes = state.collect(client, Settings(), now)["lanes"]
    assert lanes["backlog"]["in_per_min"][-2] == 4 + 16 - 10
    assert lanes["backlog"]["out_per_min"][-2] == 4


def test_one_unreadable_record_is_shown_as_such_and_never_fails_the_page(client: redis.Redis) -> None:
    from producer.ops import page

    now = time.time()
    for name, raw in {
        "a": "{oops",
        "b": "null",
        "c": "[1]",
        "d": '{"engine_slots": "four", "lanes": null}',
        # review, helper-62: each was a 500 for every operator (int(inf), int(nan), NaN in the JSON
        # answer, a KeyError in the page)
        "e": '{"engine_slots": "1e400", "engine_rows_held": "nan", "stuck_after_s": "inf"}',
        "f": '{"busy_ratio": NaN}',
        "g": '{"nested": {"x": [1e400]}}',
        "h": '{"gpu_memory_total_bytes": 80000000000}',
        "i": '{"engine_slots": 1' + "0" * 400 + ', "batch_in_progress_s": 1' + "0" * 400 + "}",
    }.items():
        client.set(names.worker_key(name), raw)
        client.zadd(names.workers_seen_key(), {names.worker_key(name): now})
    client.lpush(names.dead_letter_key(), "[1, 2]")
    client.hset(
        names.run_record_key("odd"), mapping={"state": "enqueued", "valid": "1e400", "finished_failed": "x"}
    )
    client.zadd(names.runs_recent_key(), {"odd": now})
    client.hset(
        names.ops_minute_key(ops_counts.minute_of(now)), mapping={"code|x": "many", "lat|backlog|1": 2}
    )
    client.hset(names.ops_day_key(ops_counts.day_of(now)), mapping={"k|jobs": "nan"})
    view = state.collect(client, Settings(), now)
    shown = {w["hostname"]: w for w in view["workers"]}
    assert all(shown[name].get("unreadable") for name in "abcfg")
    assert shown["d"]["engine_slots"] == 0
    assert shown["d"]["lanes"] == []
    assert (shown["e"]["engine_slots"], shown["e"]["engine_rows_held"], shown["e"]["stuck"]) == (0, 0, False)
    assert shown["h"]["gpu_memory_allocated_bytes"] == 0
    assert (shown["i"]["engine_slots"], shown["i"]["stuck"]) == (0, False)  # review, helper-65
    assert [(r["run_id"], r["jobs"], r["failed"]) for r in view["runs"]["finished"]] == [("odd", 0, 0)]
    assert view["latency"]["backlog"]["jobs"] == 2
    assert "x" not in view["errors_last_hour"]
    json.dumps(view, allow_nan=False)  # as /ops/state answers it
    assert view["dead_letter"]["newest"] == [{"job_id": "?", "code": "unreadable"}]
    html = page.page(view, 5)
    assert "unreadable heartbeat" in html
    assert "0.0 / 75 GiB" in html


def test_every_finished_run_of_the_latest_twenty_is_shown(client: redis.Redis) -> None:
    """The contract's 20 latest runs (review, helper-62: five finished ones at most)."""
    now = time.time()
    for i in range(25):
        client.hset(
            names.run_record_key(f"r{i}"), mapping={"state": "enqueued", "valid": 2, "finished_succeeded": 2}
        )
        client.zadd(names.runs_recent_key(), {f"r{i}": now - i})
    runs = state.collect(client, Settings(), now)["runs"]
    assert runs["running"] == []
    assert [r["run_id"] for r in runs["finished"]] == [f"r{i}" for i in range(20)]


def test_a_requeued_dead_letter_leaves_its_runs_progress_until_it_finishes_again(client: redis.Redis) -> None:
    from shared.records import RedisJobRecords

    records = RedisJobRecords(client)
    client.hset(names.job_key("r1.j1"), mapping={"state": "running", "run_id": "r1"})
    failed = ops_counts.Finished("backlog", "failed", "out_of_memory", 2.0)
    assert records.count_usage("r1.j1", None, {"prompt_tokens": 5}, False, failed)
    run = names.run_record_key("r1")
    assert client.hget(run, "finished_failed") == "1"
    records.reset_attempts("r1.j1", "push-2")  # `mrc dlq requeue`: it is queued again
    assert client.hget(run, "finished_failed") == "0"
    succeeded = ops_counts.Finished("backlog", "succeeded", "", 1.0)
    assert records.count_usage("r1.j1", None, {"prompt_tokens": 5}, False, succeeded)
    assert (client.hget(run, "finished_succeeded"), client.hget(run, "finished_failed")) == ("1", "0")
    assert not records.count_usage("r1.j1", None, {"prompt_tokens": 5}, False, succeeded)  # once
    assert client.hget(run, "finished_succeeded") == "1"


def test_pages_open_at_once_share_one_collection(client: redis.Redis, tmp_path: Path) -> None:
    """Review finding: every open page ran its own collection on the request threads, so a frozen Redis
    and a dozen tabs starved other routes. Requests arriving together now share one collection."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.support.api_server import serve

    url = client.connection_pool.connection_kwargs
    env = {"MRC_REDIS_URL": f"redis://{url['host']}:{url['port']}/0", "MRC_S3_BUCKET": "mrc-ops-test"}
    _fleet(client, workers=100, runs=20, dead=5, now=time.time())
    with serve(env) as api, httpx.Client(timeout=30) as http:
        assert http.get(f"{api}/ops/state").status_code == 200  # alone: one collection
        time.sleep(0.6)  # past the half second a collection answers for
        before = _commands(client)
        with ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(lambda _i: http.get(f"{api}/ops/state").status_code, range(12)))
        spent = _commands(client) - before - 1
    assert codes == [200] * 12
    assert spent <= 2 * 120, f"12 requests at once cost {spent} Redis commands"  # each alone: about 105


def test_the_backlogs_shares_are_shown_with_the_lane(client: redis.Redis) -> None:
    """Who holds the backlog lane (shared/backlog_share.py): a run waiting with the lane below its limit
    is explained there, and one key alone shows no shares."""
    from producer.ops import page

    client.hset(names.backlog_held_counts_key(), mapping={"-": 40, "a1a1a1a1a1a1": 12})
    view = state.collect(client, Settings(), time.time())
    assert view["lanes"]["backlog"]["held_by_key"] == {"-": 40, "a1a1a1a1a1a1": 12}
    assert view["lanes"]["backlog"]["share_each"] == 5000
    assert "shared by 2 keys, 5000 each (-: 40, a1a1a1a1a1a1: 12 queued or running)" in page.main(view)
    off = state.collect(client, Settings(backlog_key_shares=False), time.time())  # review, helper-104:
    assert off["lanes"]["backlog"]["share_each"] is None  # the page said "shared" with shares off
    assert "shared by" not in page.main(off)
    client.hdel(names.backlog_held_counts_key(), "a1a1a1a1a1a1")
    alone = state.collect(client, Settings(), time.time())
    assert alone["lanes"]["backlog"]["held_by_key"] == {"-": 40}
    assert alone["lanes"]["backlog"]["share_each"] is None
    assert "shared by" not in page.main(alone)
