"""One `mrc backlog` pass of a run at a time (producer/backlog/run_lease.py), against a real Redis: a
second pass is refused while the first lives, and a pass that died gives the run up: at once on its
own host, within the lease's time from another."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid

import pytest
import redis as redis_lib

from producer.backlog import run_lease
from scripts import devservices as services
from shared import names
from shared.errors import UsageError

pytestmark = pytest.mark.integration


@pytest.fixture
def client(redis_service: services.Service) -> redis_lib.Redis:
    return redis_lib.Redis.from_url(redis_service.url, decode_responses=True)


def _run_id() -> str:
    return f"lease-{uuid.uuid4().hex[:8]}"


def test_a_second_pass_is_refused_naming_the_first_and_the_run_is_free_once_it_ends(
    client: redis_lib.Redis,
) -> None:
    run_id = _run_id()
    busy = rf"run {run_id} is being enqueued by another pass \(pid \d+ on "
    first = run_lease.held(client, run_id)
    with first, pytest.raises(UsageError, match=busy), run_lease.held(client, run_id):
        pass
    with run_lease.held(client, run_id):
        assert client.exists(names.run_pass_key(run_id))
    assert not client.exists(names.run_pass_key(run_id))


def test_a_live_pass_keeps_its_lease_past_the_leases_time(client: redis_lib.Redis) -> None:
    run_id = _run_id()
    with run_lease.held(client, run_id, ttl_s=0.3):
        time.sleep(1.0)  # renewed every third of its time
        with pytest.raises(UsageError), run_lease.held(client, run_id, ttl_s=0.3):
            pass


def test_a_dead_pass_on_this_host_gives_the_run_up_at_once_and_a_live_one_does_not(
    client: redis_lib.Redis,
) -> None:
    run_id = _run_id()
    key = names.run_pass_key(run_id)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder = {
            "host": socket.gethostname(),
            "pid": sleeper.pid,
            "start": run_lease._started(sleeper.pid),
            "since": "2026-12-06T00:00:00Z",
        }
        client.set(key, json.dumps(holder), ex=600)
        with pytest.raises(UsageError, match=f"pid {sleeper.pid}"), run_lease.held(client, run_id):
            pass
        client.set(key, json.dumps({**holder, "start": "1"}), ex=600)  # its pid, another process now
        with run_lease.held(client, run_id):
            assert json.loads(client.get(key) or "{}")["pid"] != sleeper.pid
    finally:
        sleeper.kill()
        sleeper.wait()
    client.set(key, json.dumps(holder), ex=600)
    with run_lease.held(client, run_id):  # that process is gone
        pass


def test_a_pass_on_another_host_holds_the_run_until_its_lease_lapses(client: redis_lib.Redis) -> None:
    run_id = _run_id()
    key = names.run_pass_key(run_id)
    client.set(key, json.dumps({"host": "elsewhere", "pid": 1, "start": "9", "since": "then"}), px=300)
    with pytest.raises(UsageError, match="pid 1 on elsewhere"), run_lease.held(client, run_id):
        pass
    time.sleep(0.4)
    with run_lease.held(client, run_id):
        pass


def test_a_pass_whose_lease_another_took_after_redis_lost_it_is_told_to_stop(client: redis_lib.Redis) -> None:
    """Review, helper-76: Redis restarted empty, a second pass took the run, and both went on."""
    run_id = _run_id()
    with run_lease.held(client, run_id) as lease:
        lease.check()  # its own: nothing to say
        client.delete(names.run_pass_key(run_id))  # lost with Redis's data: taken again, still its own
        assert lease.renew()
        lease.check()
        client.set(names.run_pass_key(run_id), json.dumps({"host": "elsewhere", "pid": 7, "since": "now"}))
        assert not lease.renew()
        with pytest.raises(
            UsageError, match=rf"run {run_id} was taken over by another pass \(pid 7 on elsewhere"
        ):
            lease.check()
