"""Fixtures more than one unit test module takes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from scripts import devservices as services
from shared.memory_records import MemoryJobRecords
from shared.records import JobRecords, RedisJobRecords


@pytest.fixture(params=["redis", "memory"])
def any_records(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[JobRecords]:
    """The job records' Redis scripts (a redis-server of their own) and their in-process twin, which
    must decide alike."""
    if request.param == "memory":
        yield MemoryJobRecords()
        return
    server = services.start_redis(tmp_path / "redis")
    client = redis.Redis.from_url(server.url, decode_responses=True)
    yield RedisJobRecords(client)
    client.close()
    server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[services.Service]:
    """A redis-server of the test's own, stopped whatever the test raised."""
    server = services.start_redis(tmp_path / "redis")
    yield server
    server.stop()
