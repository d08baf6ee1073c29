"""Where Redis is (shared/redis_target.py): the Sentinel settings, what MRC_REDIS_URL still says when
the master comes from Sentinel, and the failover bookkeeping (the failover itself, on real processes,
is tests/faults/test_failover.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import ValidationError
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from scripts import devservices as services
from shared import redis_target
from shared.settings import Settings


@pytest.mark.parametrize("bad", ["10.0.0.5", "10.0.0.5:", "host:port", ":26379", "h:0", "h:70000"])
def test_a_sentinel_that_is_not_host_port_is_refused_at_start(bad: str) -> None:
    with pytest.raises(ValidationError, match="MRC_REDIS_SENTINELS"):
        Settings(redis_sentinels=f"127.0.0.1:26379,{bad}")


def test_sentinels_and_what_the_url_still_says() -> None:
    settings = Settings(
        redis_sentinels=" s1:26379, [::1]:26380 ,", redis_url="rediss://u:p%40ss@ignored:6379/3"
    )
    assert redis_target.sentinel_addresses(settings) == [("s1", 26379), ("::1", 26380)]
    assert redis_target.url_params(settings.redis_url) == {
        "db": 3,
        "username": "u",
        "password": "p@ss",
        "ssl": True,
    }
    options = redis_target.transport_options(settings)
    assert options["sentinels"] == [("s1", 26379), ("::1", 26380)]
    assert options["master_name"] == "mymaster"
    assert redis_target.where(settings) == "Sentinel master 'mymaster' via  s1:26379, [::1]:26380 ,"


def test_without_sentinels_the_url_is_the_master() -> None:
    settings = Settings(redis_url="redis://10.1.2.3:6380/0")
    assert not redis_target.uses_sentinel(settings)
    assert redis_target.status(settings) == {"redis_master": "10.1.2.3:6380", "redis_sentinel": False}
    assert "sentinels" not in redis_target.transport_options(settings)


def test_a_change_of_master_is_counted_once_and_per_group() -> None:
    group, other = ((("s", 1),), "m-test"), ((("t", 1),), "m-test")
    before = redis_target.failovers
    redis_target.note_master(group, ("10.0.0.1", 6379))
    redis_target.note_master(other, ("10.0.0.9", 6379))  # another cluster: not a failover
    redis_target.note_master(group, ("10.0.0.1", 6379))
    assert redis_target.failovers == before
    redis_target.note_master(group, ("10.0.0.2", 6379))
    redis_target.note_master(group, ("10.0.0.2", 6379))
    assert redis_target.failovers == before + 1


class _Answers(Sentinel):
    """Sentinels that answer as scripted (the last answer stays): what a real Sentinel answers in the
    moment after a failover it has not heard of yet, the old master, cannot be made to happen on cue.
    The Redis servers connected to are real."""

    def __init__(self, sentinel_port: int, answers: list[tuple[str, int]]) -> None:
        super().__init__([("127.0.0.1", sentinel_port)])
        self.answers = answers

    def discover_master(self, service_name: str) -> Any:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_the_master_in_use_is_the_one_connected_to_not_a_stale_sentinels_answer(
    redis_service: services.Service, tmp_path: Path
) -> None:
    sentinel_port = services.free_port()  # named, never asked: _Answers answers for it
    settings = Settings(redis_sentinels=f"127.0.0.1:{sentinel_port}", redis_sentinel_master="m-stale")
    live, dead = ("127.0.0.1", redis_service.port), ("127.0.0.1", services.free_port())
    manager = _Answers(sentinel_port, [live])
    pool = SentinelConnectionPool(
        "m-stale", manager, connection_class=redis_target.ResolvingConnection, retry=Retry(NoBackoff(), 3)
    )
    client = redis.Redis(connection_pool=pool)
    before = redis_target.failovers
    assert client.ping()
    assert redis_target.status(settings)["redis_master"] == f"127.0.0.1:{live[1]}"
    # A Sentinel not yet told of a failover names the old master, gone: that connection fails and asks
    # again. Counted, it was a change of master to a dead node, and another back.
    manager.answers = [dead, live]
    pool.disconnect()
    assert client.ping()
    assert redis_target.failovers == before
    assert redis_target.status(settings)["redis_master"] == f"127.0.0.1:{live[1]}"
    # A real change: the next connection is made to another server.
    other = services.start_redis(tmp_path / "other")
    try:
        manager.answers = [("127.0.0.1", other.port)]
        pool.disconnect()
        assert client.ping()
        assert redis_target.failovers == before + 1
        assert redis_target.status(settings)["redis_master"] == f"127.0.0.1:{other.port}"
    finally:
        pool.disconnect()
        other.stop()


def test_a_broker_connection_going_back_to_its_old_address_is_no_failover(tmp_path: Path) -> None:
    """The broker's connections do not ask the Sentinels on a command's retry (kombu reconnects its
    channel itself): on READONLY from a demoted master, redis-py's retry reconnects the same object to
    the address it had. Noted, that connection to the demoted node was a second failover, back to it,
    and /readyz named it (a review's find). Only an address a Sentinel has just named is noted."""
    sentinel_port = services.free_port()
    settings = Settings(redis_sentinels=f"127.0.0.1:{sentinel_port}", redis_sentinel_master="m-demoted")
    old, promoted = services.start_redis(tmp_path / "old"), services.start_redis(tmp_path / "new")
    new = ("127.0.0.1", promoted.port)  # not the session's server: this one gets a replica
    manager = _Answers(sentinel_port, [("127.0.0.1", old.port)])
    own = SentinelConnectionPool(
        "m-demoted", manager, connection_class=redis_target.ResolvingConnection, retry=Retry(NoBackoff(), 3)
    )
    broker = SentinelConnectionPool(  # as shared/celery_app.py sets the broker's connections
        "m-demoted", manager, connection_class=redis_target.FailoverConnection, retry_on_timeout=True
    )
    try:
        redis.Redis(connection_pool=own).set("demoted-x", 1)
        redis.Redis(connection_pool=broker).set("demoted-y", 1)
        before = redis_target.failovers
        redis.Redis(port=old.port).replicaof(*new)  # the failover: the old master, alive, a replica
        manager.answers = [new]
        redis.Redis(connection_pool=own).set("demoted-x", 2)  # READONLY: asks again, finds the new one
        assert redis_target.failovers == before + 1
        with contextlib.suppress(redis.RedisError):  # the broker's retry goes back to the old node
            redis.Redis(connection_pool=broker).set("demoted-y", 2)
        assert redis_target.failovers == before + 1
        assert redis_target.status(settings)["redis_master"] == f"127.0.0.1:{new[1]}"
    finally:
        own.disconnect()
        broker.disconnect()
        old.stop()
        promoted.stop()


_PIPELINE = "Command # 1 (HSETNX mrc:run:rf created_at 2026-12-06T06:56:55Z) of pipeline caused error: "


@pytest.mark.parametrize(
    ("exc", "now", "words"),
    [
        (redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), True,
         "OOM command not allowed when used memory > 'maxmemory'."),
        # a pipeline's error quotes its command, keys and arguments: never handed on (review)
        (redis.exceptions.OutOfMemoryError(_PIPELINE + "command not allowed when used memory > 'maxmemory'."),
         True, "OOM command not allowed when used memory > 'maxmemory'."),
        (redis.ResponseError(_PIPELINE + "BUSY Redis is busy running a script."), True,
         "BUSY Redis is busy running a script."),
        (redis.ResponseError("NOREPLICAS Not enough good replicas to write."), True,
         "NOREPLICAS Not enough good replicas to write."),
        (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), True,
         "You can't write against a read only replica."),
        (redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), False,
         "WRONGTYPE Operation against a key holding the wrong kind of value"),
        (redis.ConnectionError("Connection refused"), False, "Connection refused"),
    ],
)  # fmt: skip
def test_a_refusal_for_now_is_told_apart_and_said_in_its_words(exc: Exception, now: bool, words: str) -> None:
    assert redis_target.refused_for_now(exc) is now
    assert redis_target.refusal_words(exc) == words


def test_threads_that_ask_the_sentinels_at_once_keep_every_sentinel_and_the_masters_key(
    tmp_path: Path,
) -> None:
    """CI, twice: a worker followed a failover but never logged it, and /readyz named the dead master.
    redis-py moves the Sentinel that answered to the front of its list by the index it found it at,
    unlocked: threads that asked at once (every connection a failover remakes) left one Sentinel in
    the list twice and another gone, and the master's key, read off that list, was another key. Here
    the first Sentinel listed is not there (refused at once), so every thread is answered by the
    second and moves it to the front, round after round."""
    import threading

    from scripts import sentinel_cluster

    cluster = sentinel_cluster.start(tmp_path / "cluster", replicas=0, sentinels=2)
    addresses = [("127.0.0.1", services.free_port()), *(("127.0.0.1", s.port) for s in cluster.sentinels)]
    # No retry of a refused connection (redis-py's default backs off and tries 3 times more): fast rounds.
    manager = redis_target.manager_for(addresses, {"socket_timeout": 5.0, "retry": Retry(NoBackoff(), 0)})
    first = list(manager.sentinels)
    found: list[tuple[str, int]] = []
    try:
        for _ in range(40):
            manager.sentinels[:] = first
            start = threading.Barrier(8)

            def discover(start: threading.Barrier = start) -> None:
                start.wait()
                found.append(manager.discover_master(sentinel_cluster.MASTER))

            threads = [threading.Thread(target=discover) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            listed = [_address(s) for s in manager.sentinels]
            assert sorted(listed) == sorted(addresses)  # each Sentinel once
            assert listed[0] != addresses[0]  # one that answers is asked first now
    finally:
        cluster.stop()
    assert found == [("127.0.0.1", cluster.nodes[0].port)] * 40 * 8
    settings = Settings(
        redis_sentinels=",".join(f"{h}:{p}" for h, p in reversed(addresses)),
        redis_sentinel_master=sentinel_cluster.MASTER,
    )
    redis_target.note_master(redis_target.group_of(manager, sentinel_cluster.MASTER), ("127.0.0.1", 1))
    assert redis_target.status(settings)["redis_master"] == "127.0.0.1:1"


def _address(sentinel: redis.Redis) -> tuple[str, int]:
    kwargs = sentinel.connection_pool.connection_kwargs
    return str(kwargs["host"]), int(kwargs["port"])
