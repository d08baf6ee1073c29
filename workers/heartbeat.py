"""Each worker announces itself in Redis every few seconds, so `mrc queues` can show who is serving
which lanes with which model, and how busy they are. An entry expires when its worker stops beating."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable

import redis

from shared import logs, names
from shared.jobs import now_rfc3339

INTERVAL_S = 5.0
TTL_S = 15

# One step: the beat, and its time in the seen set by Redis's clock, not the worker's (every host's
# clock differs: a worker whose clock ran a minute behind another's was let go from the list by that
# one's prune every minute, and shown dead while it served). With `prune`, the members no beat has named
# for WORKER_SEEN_S go (killed workers), by the same clock.
_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
redis.call('ZADD', KEYS[2], now, KEYS[1])
if ARGV[3] == '1' then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[4]))
end
return 1
"""


class Heartbeat:
    def __init__(
        self,
        client: redis.Redis,
        hostname: str,
        describe: Callable[[], dict[str, object]],
        every_minute: Callable[[], None] = lambda: None,
    ) -> None:
        self._redis = client
        self._every_minute, self._minute = every_minute, -1
        self._key = names.worker_key(hostname)
        self.describe = describe  # what the next beat says (a worker says more once it is ready)
        self._beat = client.register_script(_BEAT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mrc-heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(redis.RedisError):  # else the entry expires by itself
            self._redis.delete(self._key)
            self._redis.zrem(names.workers_seen_key(), self._key)  # gone, not dead, on the ops page

    def beat(self) -> None:
        state = {**self.describe(), "seen_at": now_rfc3339()}
        minute = int(time.time() // 60)  # a cadence only: this host's clock is good enough
        # once a minute, the workers no beat has named for a while (killed ones) go too: only the ops
        # page let them go before, so a fleet no one looked at kept one per crash (review, helper-115)
        prune = minute != self._minute
        keys = [self._key, names.workers_seen_key()]
        self._beat(keys=keys, args=[json.dumps(state), TTL_S, "1" if prune else "0", names.WORKER_SEEN_S])
        if prune:  # the lanes' depth for the ops page, once a minute per worker
            self._minute = minute
            self._every_minute()

    def _run(self) -> None:
        lost: float | None = None  # when a beat first failed, while they fail
        while not self._stop.wait(INTERVAL_S):
            try:
                self.beat()
            except redis.RedisError as exc:  # Redis restarting: the next beat catches up
                if lost is None:  # once a spell, in mrc's words (review, helper-93: only Celery's
                    lost = time.monotonic()  # tracebacks said Redis was gone)
                    logs.get_logger().warning("MRC_REDIS_UNREACHABLE", error=repr(exc)[:300])
                continue
            if lost is not None:
                logs.get_logger().info("MRC_REDIS_BACK", after_s=round(time.monotonic() - lost, 1))
                lost = None
