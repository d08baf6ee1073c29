"""Where Redis is (shared/redis_target.py): the Sentinel settings, what MRC_REDIS_URL still says when
the master comes from Sentinel, and the failover bookkeeping (the failover itself, on real processes,
is tests/faults/test_failover.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

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
