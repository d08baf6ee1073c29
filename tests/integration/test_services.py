"""The test session's own services (scripts/devservices.py): a server that could not bind its port is
never taken for up because another one answers there. Two parallel tests given one port by `free_port`
(the second's server then exits: address in use) both took the first's server for theirs, and one lost
its S3 when the other stopped it (a fresh-clone CI run's failover test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import devservices as services

pytestmark = pytest.mark.integration


def test_a_second_moto_server_on_a_taken_port_is_not_up(tmp_path: Path) -> None:
    first = services._start_s3(tmp_path / "a", services.free_port())
    try:
        with pytest.raises(RuntimeError, match="moto_server"):
            services._start_s3(tmp_path / "b", first.port)
    finally:
        first.stop()


def test_a_second_redis_server_on_a_taken_port_is_not_up(tmp_path: Path) -> None:
    first = services._start_redis(tmp_path / "a", False, services.free_port(), None)
    try:
        with pytest.raises(RuntimeError, match="redis-server"):
            services._start_redis(tmp_path / "b", False, first.port, None)
    finally:
        first.stop()
