"""One `mrc backlog` pass of a run at a time.

Two passes of one run at once (a cron job started again while the last is still enqueueing, a retry
wrapper beside the first try) never queue a job twice (shared/runs.py), but each counts the chunks it
indexes into the run's record, so `status` read twice the lines. A pass holds the run's lease in Redis
while it enqueues: a second pass is refused, naming the holder, and exits 2.

A pass that died gives its lease up by itself: at once to a pass on the same host (the holder's
process is gone: its pid no longer runs the process that took the lease), else within `TTL_S` (a live
pass renews its lease every third of that, from a thread of its own, so a long upload or a wait for
room never lets it lapse). OpenAI batches have a lease of their own (producer/openai/batch_run.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from shared import names
from shared.errors import UsageError
from shared.jobs import now_rfc3339

TTL_S = 30

# KEYS[1] the lease; ARGV: the holder's value, the ttl in ms. Renewed (or taken again, if it lapsed and none
# took it) only for its holder. 1 if held now.
_RENEW = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS[1] the lease; ARGV: the dead holder's value, the new one, the ttl in ms. 1 if taken over.
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Lease:
    """A pass's hold on its run. Redis that lost its data loses the lease too, and a second pass may
    take it then (review, helper-76: both passes went on): `check` says so to the first."""

    def __init__(self, client: redis.Redis, run_id: str, me: str, ttl_ms: int) -> None:
        self.client, self.run_id, self.me, self.ttl_ms = client, run_id, me, ttl_ms
        self.key = names.run_pass_key(run_id)
        self.taken = threading.Event()  # another pass holds the run now (seen by the renewer)

    def renew(self) -> bool:
        """Renewed, or taken again where it lapsed (or Redis lost it) and none took it; False where
        another pass holds it, which `check` then raises."""
        if self.client.eval(_RENEW, 1, self.key, self.me, self.ttl_ms):
            return True
        self.taken.set()
        return False

    def check(self) -> None:
        """UsageError once another pass holds the run: this one stops (its jobs stay queued)."""
        if self.taken.is_set():
            holder = _get(self.client, self.key)
            raise UsageError(
                f"run {self.run_id} was taken over by another pass ({_who(holder)}) while this one "
                "enqueued it (Redis lost this pass's lease: restarted without its data?); this pass "
                "stops, what it queued stays queued"
            )


@contextlib.contextmanager
def held(client: redis.Redis, run_id: str, ttl_s: float = TTL_S) -> Iterator[Lease]:
    """The run's lease for the block's length; UsageError when another pass holds it."""
    key, me, ttl_ms = names.run_pass_key(run_id), _holder(), max(1, int(ttl_s * 1000))
    if not client.set(key, me, nx=True, px=ttl_ms):
        holder = _get(client, key)
        if holder is None or not _alive(holder):  # lapsed meanwhile, or its process is gone
            if not client.eval(_TAKE_OVER, 1, key, holder or "", me, ttl_ms) and not client.set(
                key, me, nx=True, px=ttl_ms
            ):
                raise _busy(run_id, _get(client, key))
        else:
            raise _busy(run_id, holder)
    lease = Lease(client, run_id, me, ttl_ms)
    stop = threading.Event()
    renewer = threading.Thread(target=_renew, args=(lease, stop), daemon=True)
    renewer.start()
    try:
        yield lease
    finally:
        stop.set()
        renewer.join()
        with contextlib.suppress(redis.RedisError):  # Redis away: the lease lapses by itself
            client.eval(_RELEASE, 1, key, me)


def _renew(lease: Lease, stop: threading.Event) -> None:
    while not stop.wait(lease.ttl_ms / 3000):
        with contextlib.suppress(redis.RedisError):  # an outage: the pass waits it out, the lease too
            if not lease.renew():
                return


def _get(client: redis.Redis, key: str) -> str | None:
    value = client.get(key)
    return value.decode() if isinstance(value, bytes) else str(value) if value is not None else None


def _holder() -> str:
    return json.dumps(
        {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start": _started(os.getpid()),
            "since": now_rfc3339(),
        }
    )


def _started(pid: int) -> str | None:
    """When process `pid` began, in clock ticks since boot (/proc/PID/stat field 22): a pid reused by
    another process reads another start. None where /proc is not there or the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # fields after the name, which may hold spaces


def _alive(holder: str) -> bool:
    """Whether the pass named by `holder` may still be running: on another host, yes (its lease lapses
    when it stops renewing); on this one, if its process still runs."""
    info = _parse(holder)
    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return True
    started = _started(info["pid"])
    return started is not None and started == info.get("start")


def _parse(holder: str) -> dict[str, Any]:
    try:
        info = json.loads(holder)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _who(holder: str | None) -> str:
    info = _parse(holder or "")
    return (
        f"pid {info.get('pid')} on {info.get('host')}, since {info.get('since')}"
        if info
        else "another process"
    )


def _busy(run_id: str, holder: str | None) -> UsageError:
    return UsageError(
        f"run {run_id} is being enqueued by another pass ({_who(holder)}); one pass of a run at a time: "
        f"wait for it to end (`mrc backlog status {run_id}`), or stop it; a pass that died gives the run "
        f"up within {TTL_S} s"
    )
