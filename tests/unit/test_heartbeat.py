"""The worker's heartbeat says, once a spell, when Redis goes away and when it is back: before, only
Celery's own tracebacks did (review, helper-93)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from structlog.testing import capture_logs

from scripts import devservices as services
from workers import heartbeat


def _wait(check: object, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the time given"
        time.sleep(0.05)


def test_redis_gone_and_back_is_said_once_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heartbeat, "INTERVAL_S", 0.05)
    server = services.start_redis(tmp_path / "redis")
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    client = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
    beats = heartbeat.Heartbeat(client, "w1", lambda: {"lanes": ["interactive"]})
    with capture_logs() as logged:
        beats.start()
        try:
            server.stop()

            def said(event: str) -> list[dict[str, object]]:
                return [line for line in logged if line["event"] == event]

            _wait(lambda: said("MRC_REDIS_UNREACHABLE"))
            time.sleep(0.3)  # several more beats fail: still one line
            server = services.start_redis(tmp_path / "redis", port=port)
            _wait(lambda: said("MRC_REDIS_BACK"))
            time.sleep(0.3)
            assert len(said("MRC_REDIS_UNREACHABLE")) == len(said("MRC_REDIS_BACK")) == 1
            assert float(said("MRC_REDIS_BACK")[0]["after_s"]) > 0  # type: ignore[arg-type]
        finally:
            beats.stop()
            client.close()
            server.stop()
