"""mrc-api's front layer on its own (an ASGI app stands in for the routes): the bound on bodies read
at once, and what a refused caller's body costs."""

from __future__ import annotations

import asyncio
from typing import Any

from producer.api_front import Front, Limits
from producer.api_guard import Keys, RateLimiter


def _front(app: Any, bodies: int = 1) -> tuple[Front, list[tuple[str, int]]]:
    counted: list[tuple[str, int]] = []
    limits = Limits(body_bytes=1000, bodies=bodies, drain_bytes=10_000, body_wait_s=0.2)
    front = Front(
        app,
        Keys(""),
        RateLimiter(0, 1),
        limits,
        lambda route, _m, status, _s: counted.append((route, status)),
    )
    return front, counted


async def _request(front: Front, body: bytes) -> int:
    scope = {"type": "http", "method": "POST", "path": "/v1/jobs", "headers": [], "client": ("127.0.0.1", 1)}
    sent: list[dict[str, Any]] = []
    parts = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if parts:
            return parts.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await front(scope, receive, send)
    return int(next(m["status"] for m in sent if m["type"] == "http.response.start"))


def test_no_more_bodies_are_read_at_once_than_the_bound() -> None:
    """One upload in progress (its route holds the body); a second waits its turn, then is a 503."""
    release, entered = asyncio.Event(), asyncio.Event()

    async def slow_route(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        entered.set()
        await release.wait()
        await send({"type": "http.response.start", "status": 202, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def both() -> tuple[int, int]:
        first = asyncio.create_task(_request(front, b"{}"))
        await entered.wait()  # the first upload holds its turn
        second = await _request(front, b"{}")
        release.set()
        return await first, second

    front, counted = _front(slow_route)
    assert asyncio.run(both()) == (202, 503)
    assert sorted(status for _route, status in counted) == [202, 503]
