"""The threads that fetch and decode (and, in pools of their own, write results), one pool per lane."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from shared import names
from workers import images
from workers.slots import Slot

T = TypeVar("T")


class LanePools:
    """One pool per lane: a ticket's image is never decoded behind the sixteen of a backlog delivery
    that arrived just before it."""

    def __init__(self, threads: int, what: str = "", decodes: bool = True) -> None:
        """`decodes`: its threads run ATen ops (each gets one OpenMP thread: images.init_decode_thread);
        a pool of S3 round trips runs none."""
        init = images.init_decode_thread if decodes else None
        self.pools = {
            lane: ThreadPoolExecutor(threads, thread_name_prefix=f"mrc-{lane}{what}", initializer=init)
            for lane in names.LANES
        }

    def submit(self, slot: Slot, work: Callable[..., T], *args: Any) -> Future[T]:
        lane = slot.job.lane if slot.job is not None else "interactive"
        return self.pools.get(lane, self.pools["interactive"]).submit(work, *args)

    def shutdown(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
