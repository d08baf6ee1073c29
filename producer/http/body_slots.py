"""Turns to read a request body (MRC_API_MAX_BODIES at once: memory is that times a body's limit), shared
so that no one key can hold them all: a key takes at most half, and requests no key let in (the ops
page's login form) read from a small pool of their own beside them. With keys off every caller is
one, as it is for the rate limit's purposes not: no share then (behind a proxy every client has one
address). A body must keep arriving (front.py), or the request ends 408 and gives its turn back.

Review: eight connections that sent `POST /ops/login` headers and then a trickle of body held every
turn, with no key and no deadline, and every keyed POST answered 503 for as long as they stayed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

BUSY = "too many uploads at once"
YOURS = "this caller's uploads take half the turns already"


class BodySlots:
    def __init__(self, turns: int, wait_s: float) -> None:
        self.turns, self.wait_s = turns, wait_s
        self.share = max(1, turns // 2)  # the most one caller reads at once
        self._keyed: asyncio.Semaphore | None = None  # made in the serving loop, on first use
        self._keyless: asyncio.Semaphore | None = None
        self._held: dict[str, int] = {}

    async def take(self, who: str | None, let_in: bool = True) -> Callable[[], None] | str:
        """A turn (call what comes back to give it back, once), or why there is none. `who`: the key,
        held to its share (None: no share); `let_in`: false for a request no key let in."""
        if self._keyed is None or self._keyless is None:
            self._keyed = asyncio.Semaphore(self.turns)
            self._keyless = asyncio.Semaphore(max(1, self.turns // 4))
        if who is not None and self._held.get(who, 0) >= self.share:
            return YOURS
        pool = self._keyed if let_in else self._keyless
        if who is not None:
            self._held[who] = self._held.get(who, 0) + 1
        try:
            await asyncio.wait_for(pool.acquire(), self.wait_s)
        except TimeoutError:
            self._drop(who)
            return BUSY
        except BaseException:  # the request was cancelled while it waited: its count goes too (review)
            self._drop(who)
            raise
        given = [False]

        def give_back() -> None:
            if not given[0]:
                given[0] = True
                pool.release()
                self._drop(who)

        return give_back

    def _drop(self, who: str | None) -> None:
        if who is not None:
            left = self._held.get(who, 1) - 1
            if left:
                self._held[who] = left
            else:
                self._held.pop(who, None)
