"""Which messages start a delivery at once (workers/tasks.py): a fresh ticket, not a backlog job, a
retry waiting out its countdown, or a message given back or restored after its worker died (those
gather, so that the suspects among them run in groups, not each alone)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from shared import names
from workers.tasks import _fresh_ticket


def _message(queue: str, **headers: Any) -> tuple[Any, dict[str, Any]]:
    return SimpleNamespace(delivery_info={"routing_key": queue}, headers=headers), headers


@pytest.mark.parametrize(
    ("queue", "headers", "fresh"),
    [
        (names.queue_name("interactive"), {}, True),
        (names.queue_name("interactive"), {"eta": None, "redelivered": False}, True),
        (names.queue_name("backlog"), {}, False),
        (names.queue_name("interactive"), {"eta": "2026-12-07T10:00:00+00:00"}, False),
        (names.queue_name("interactive"), {"redelivered": True}, False),
        ("", {}, False),
    ],
)
def test_only_a_fresh_ticket_starts_its_delivery_at_once(
    queue: str, headers: dict[str, Any], fresh: bool
) -> None:
    message, read = _message(queue, **headers)
    assert _fresh_ticket(message, read) is fresh


def test_a_message_without_delivery_info_waits_as_before() -> None:
    assert _fresh_ticket(SimpleNamespace(), {}) is False
