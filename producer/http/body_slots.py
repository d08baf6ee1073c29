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
HEAVY = "too many large chat bodies at once"


class BodySlots:
    def __init__(self, turns: int, wait_s: float) -> None:
        self.turns, self.wait_s = turns, wait_s
        self.share = max(1, turns // 2)  # the most one caller reads at once
        self._keyed: asyncio.Semaphore | None = None  # made in the serving loop, on first use
        self._keyless: asyncio.Semaphore | None = None
        # Bodies that cost several times their size to read (a chat request's base64 image: its text,
        # its string and its bytes, ~3.75x): a quarter of the turns at most, so the bodies in memory stay
        # near MRC_API_MAX_BODIES x the body limit (review, helper-83: eight 43 MB chat bodies took
        # 1.3 GB, past the API's 1 GiB in deploy/k8s/api.yaml).
        self.heavy_turns = max(1, turns // 4)
        self._heavy: asyncio.Semaphore | None = None
        self._mine: dict[str, asyncio.Semaphore] = {}  # each caller's share, while it asks or holds
        self._users: dict[str, int] = {}

    async def take(
        self, who: str | None, let_in: bool = True, heavy: bool = False
    ) -> Callable[[], None] | str:
        """A turn (call what comes back to give it back, once), or why there is none within the wait.
        `who`: the key, held to its share, where it waits as it would for the pool (review: a key past
        its share was answered 503 at once, where the contract promises the wait); None: no share.
        `let_in`: false for a request no key let in. `heavy`: a body that costs several times its size
        to read, which also takes one of `heavy_turns` (first: it waits for one holding no other)."""
        if self._keyed is None or self._keyless is None or self._heavy is None:
            self._keyed = asyncio.Semaphore(self.turns)
            self._keyless = asyncio.Semaphore(max(1, self.turns // 4))
            self._heavy = asyncio.Semaphore(self.heavy_turns)
        loop = asyncio.get_running_loop()
        until = loop.time() + self.wait_s
        if not heavy:
            return await self._take(who, let_in, until)
        large = self._heavy
        if not await _within(large, until - loop.time()):
            return HEAVY
        try:
            turn = await self._take(who, let_in, until)
        except BaseException:
            large.release()
            raise
        if isinstance(turn, str):
            large.release()
            return turn

        def give_both() -> None:
            if not given[0]:
                given[0] = True
                turn()
                large.release()

        given = [False]
        return give_both

    async def _take(self, who: str | None, let_in: bool, until: float) -> Callable[[], None] | str:
        pool = self._keyed if let_in else self._keyless
        assert pool is not None
        loop = asyncio.get_running_loop()
        mine = self._join(who)
        try:
            if mine is not None and not await _within(mine, until - loop.time()):
                self._leave(who)
                return YOURS
        except BaseException:  # the request was cancelled while it waited: its place goes too (review)
            self._leave(who)
            raise
        try:
            if not await _within(pool, until - loop.time()):
                self._give(mine, who)
                return BUSY
        except BaseException:
            self._give(mine, who)
            raise
        given = [False]

        def give_back() -> None:
            if not given[0]:
                given[0] = True
                pool.release()
                self._give(mine, who)

        return give_back

    def _join(self, who: str | None) -> asyncio.Semaphore | None:
        if who is None:
            return None
        self._users[who] = self._users.get(who, 0) + 1
        return self._mine.setdefault(who, asyncio.Semaphore(self.share))

    def _leave(self, who: str | None) -> None:
        if who is None:
            return
        left = self._users.get(who, 1) - 1
        if left:
            self._users[who] = left
        else:  # nobody of this caller asks or holds: its share is forgotten
            self._users.pop(who, None)
            self._mine.pop(who, None)

    def _give(self, mine: asyncio.Semaphore | None, who: str | None) -> None:
        if mine is not None:
            mine.release()
        self._leave(who)


async def _within(turns: asyncio.Semaphore, wait_s: float) -> bool:
    """One of `turns` within `wait_s` (at once when one is free, however little time is left)."""
    if not turns.locked():
        await turns.acquire()
        return True
    try:
        await asyncio.wait_for(turns.acquire(), max(wait_s, 0.001))
    except TimeoutError:
        return False
    return True
