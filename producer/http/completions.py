"""Wakes mrc-api's result waits as their jobs finish. One thread per API process follows the fleet's
completion events (the stream workers/finisher.py appends to once a job's result and record are
written) and sets the event of every request waiting for that job, so `GET /v1/jobs/ID/result?wait=`
and a chat completion answer as their job ends, not up to a record poll later.

A hint, never the truth: the waits still read the job's record every RECORD_POLL_S and S3 at their own
pace (producer/http/waits.py), so an event lost, late or never written (Redis away, the follower
restarting) costs the poll interval, never an answer. The follower starts with the first wait (an API
whose Redis is away still starts; one that ended is started again by the next wait), holds one Redis
connection of its own, reads from the newest event again after an error, and logs
MRC_COMPLETIONS_UNFOLLOWED once when it loses the stream (the waits poll until a read succeeds again).
Closing it never blocks the caller (the API's event loop at shutdown): its connection is dropped,
which ends a read in progress (one just starting makes a new connection and runs its READ_MS out),
and the follower ends there."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from shared import logs, names

READ_MS = 1000  # one blocking read of the stream at most this long: well inside the socket timeout
RETRY_S = 1.0  # after a failed read, the pause before the next connection


class Completions:
    def __init__(self, connect: Callable[[], Any]) -> None:
        """`connect`: a Redis client (decoded responses) for the follower's own use."""
        self._connect = connect
        self._lock = threading.Lock()
        self._waiting: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self.following = threading.Event()  # set once the follower has read the stream's newest id

    @contextlib.contextmanager
    def watching(self, job_id: str) -> Iterator[asyncio.Event]:
        """An event set when the job's completion event is read, for as long as the caller waits.
        Registered before the caller's first look at the job: a completion after that look wakes it."""
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiting.setdefault(job_id, []).append(entry)
            self._start()
        try:
            yield entry[1]
        finally:
            with self._lock:
                entries = self._waiting.get(job_id, [])
                if entry in entries:
                    entries.remove(entry)
                if not entries:
                    self._waiting.pop(job_id, None)

    def close(self) -> None:
        self._stop.set()
        client = self._client
        if client is not None:  # ends a blocked read now (the thread sees the stop as it fails)
            with contextlib.suppress(Exception):
                client.connection_pool.disconnect()

    def _start(self) -> None:
        """The follower, unless it runs: started by the first wait, and again by a wait after it ended
        (a fault in the thread itself). One that cannot start (no thread to be had) is tried again
        by the next wait; this one polls meanwhile, as in an outage."""
        if (self._thread is not None and self._thread.is_alive()) or self._stop.is_set():
            return
        self._thread = threading.Thread(target=self._follow, name="mrc-completions", daemon=True)
        try:
            self._thread.start()
        except Exception as exc:
            self._thread = None
            with contextlib.suppress(Exception):
                logs.get_logger().warning("MRC_COMPLETIONS_UNFOLLOWED", error=repr(exc)[:200])

    def _follow(self) -> None:
        after: str | None = None
        told = False  # MRC_COMPLETIONS_UNFOLLOWED once per outage
        while not self._stop.is_set():
            try:
                if self._client is None:
                    self._client = self._connect()
                if after is None:  # from the newest: what came before is for the waits' own looks
                    newest = self._client.xrevrange(names.events_key(), count=1)
                    after = str(newest[0][0]) if newest else "0-0"
                    self.following.set()
                if self._stop.is_set():  # closed while it connected: the close found no connection
                    break
                reply = self._client.xread({names.events_key(): after}, count=1000, block=READ_MS)
                told = False  # a read, not only a connection, ends an outage
                for _stream, entries in reply or []:
                    for event_id, fields in entries:
                        after = str(event_id)
                        self._wake(fields.get("job_id"))
            except Exception as exc:  # Redis away, failing over or refusing: the waits poll meanwhile
                self.following.clear()
                if not told and not self._stop.is_set():
                    told = True
                    with contextlib.suppress(Exception):  # the log itself failing must not end the thread
                        logs.get_logger().warning("MRC_COMPLETIONS_UNFOLLOWED", error=repr(exc)[:200])
                self._drop_client()
                after = None
                self._stop.wait(RETRY_S)
        self._drop_client()

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def _wake(self, job_id: str | None) -> None:
        with self._lock:
            entries = list(self._waiting.get(job_id or "", ()))
        for loop, event in entries:
            with contextlib.suppress(RuntimeError):  # its loop closed: the request is gone
                loop.call_soon_threadsafe(event.set)
