"""A deadline for each request's line and headers, under uvicorn's h11 server.

uvicorn reads a request's head with no time limit: its keep-alive timer runs only between requests,
and MRC_API_BODY_TIMEOUT_S (producer/http/front.py) only once a route reads the body. A client that
sent one header line every few seconds held its connection (and a file descriptor) for ever, before
any key was asked for: 4,000 such connections took 4,027 of mrc-api's descriptors (review,
helper-97). Here the whole head must arrive within MRC_API_HEADER_TIMEOUT_S of its first byte (of the
connection, for the first request), or the connection is closed.
"""

from __future__ import annotations

import asyncio
import functools

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@functools.cache
def _limit_s() -> float:
    """Read once per process: mrc-api's worker processes (MRC_API_WORKERS) build this class themselves."""
    from shared.settings import Settings

    return Settings().api_header_timeout_s


class HeadersInTime(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request head is late."""

    limit_s: float | None = None  # None: MRC_API_HEADER_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self._awaiting_head():
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if not self._awaiting_head():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        """No whole request head yet: h11 leaves the client's side IDLE until it has one."""
        return self.conn.their_state is h11.IDLE

    def _arm(self) -> None:
        self._disarm()
        limit = self.limit_s if self.limit_s is not None else _limit_s()
        self._deadline = self.loop.call_later(limit, self._late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self) -> None:
        self._deadline = None
        if self._awaiting_head() and not self.transport.is_closing():
            self.transport.close()
