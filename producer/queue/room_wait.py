"""A single backlog submission's wait for room on the lane: QueueFull, or a moment's sleep before its
claim tries again (the claim takes the room: shared/backlog_share.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from shared import backlog_share
from shared.errors import QueueFull
from shared.settings import Settings

RETRY_S = 0.5  # between claims that found no room


@dataclass
class RoomWait:
    """One submission's wait: `block` (or raise at once), up to `timeout` seconds."""

    block: bool
    timeout: float | None
    deadline: float | None
    logged: bool = False  # MRC_BACKPRESSURE is written once a wait
    looked: bool = False  # for a result stored under the job's id (it needs no room then)

    @classmethod
    def of(cls, block: bool, timeout: float | None) -> RoomWait:
        return cls(block, timeout, None if timeout is None else time.monotonic() + timeout)

    def refuse_or_wait(self, room: backlog_share.Room, owner: str, settings: Settings, log: Any) -> None:
        """No room for `owner`: raise QueueFull (not blocking, or past the deadline), or wait a moment."""
        limit = settings.backlog_max_depth
        why = room.refusal(limit, settings.backlog_key_shares, owner)
        if not self.block:
            raise QueueFull(room.depth, limit, why)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            waited = f"still full after {self.timeout or 0:g} s; nothing enqueued"
            raise QueueFull(room.depth, limit, f"{why}; {waited}" if why else waited)
        if not self.logged:
            log.info("MRC_BACKPRESSURE", lane="backlog", depth=room.depth, limit=limit, held=room.held,
                     keys=room.keys)  # fmt: skip
            self.logged = True
        time.sleep(RETRY_S)
