"""What Redis keeps per worker and per batch is let go by the writes themselves, not only when someone
reads the ops page or pages a list (review, helper-115: a killed worker's member of the seen set, and
a key's batch ids, stayed until such a read met them)."""

from __future__ import annotations

import time

import pytest
import redis

from producer.openai.batch_book import BatchBook
from scripts import devservices as services
from shared import names
from shared.runs import RUN_TTL_S
from shared.settings import Settings
from workers.heartbeat import Heartbeat


def test_a_beat_lets_go_of_workers_no_beat_has_named_for_a_while(redis_server: services.Service) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    seen = names.workers_seen_key()
    client.zadd(seen, {names.worker_key("killed"): time.time() - names.WORKER_SEEN_S - 5})
    client.zadd(seen, {names.worker_key("recent"): time.time() - 5})
    Heartbeat(client, "alive", lambda: {"hostname": "alive"}).beat()
    assert sorted(client.zrange(seen, 0, -1)) == [names.worker_key("alive"), names.worker_key("recent")]
    client.close()


def test_creating_a_batch_lets_go_of_the_keys_batch_ids_whose_records_expired(
    redis_server: services.Service,
) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    book, listing, now = BatchBook(client), names.batches_key("k"), time.time()
    client.zadd(listing, {"batch_expired": now - RUN_TTL_S - 5, "batch_kept": now - RUN_TTL_S + 600})
    book.create("batch_new", "k", {"created_at": str(int(now)), "status": "validating"})
    assert client.zrange(listing, 0, -1) == ["batch_kept", "batch_new"]
    assert 0 < client.ttl(listing) <= RUN_TTL_S
    client.close()


def test_a_worker_whose_clock_is_minutes_off_stays_listed_and_on_time(
    redis_server: services.Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review (known since helper-115's fix): each beat wrote its time, and each prune its cut-off, by
    its own host's clock, so a worker whose clock ran two minutes behind another's was let go by that
    one's prune once a minute and vanished from the ops page while it served (and one ahead was shown
    late forever). Both now come from Redis's clock."""
    from producer.ops import state
    from workers import heartbeat

    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    seen = names.workers_seen_key()
    client.delete(seen)

    class Behind:  # this host's clock, two minutes slow
        @staticmethod
        def time() -> float:
            return time.time() - 120

    monkeypatch.setattr(heartbeat, "time", Behind)
    Heartbeat(client, "behind", lambda: {"hostname": "behind"}).beat()
    monkeypatch.undo()
    Heartbeat(client, "alive", lambda: {"hostname": "alive"}).beat()  # its prune comes first
    assert sorted(client.zrange(seen, 0, -1)) == [names.worker_key("alive"), names.worker_key("behind")]
    shown = {w["hostname"]: w for w in state.collect(client, Settings())["workers"]}
    assert set(shown) == {"alive", "behind"}
    assert not shown["behind"]["late"]
    assert shown["behind"]["beat_age_s"] < 10
    client.close()
