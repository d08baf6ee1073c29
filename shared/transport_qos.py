"""The quality-of-service half of mrc's Redis transport (shared/transport.py): which messages a consumer
holds unacked, their heartbeat, their ack (with the push marker, shared/pushes.py) and their restore
after a consumer dies (one visibility timeout after its last beat)."""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import structlog
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual as kombu_virtual
from kombu.utils.encoding import bytes_to_str

from shared import names, pushes, queue_entries
from shared.unacked import parse_unacked, process_owner


class _Heartbeat(threading.Thread):
    """Refreshes the unacked records of the messages a live consumer holds, so that only a consumer
    that died (or whose main thread ended) has its messages handed out again."""

    def __init__(self, qos: QoS, interval_s: float) -> None:
        super().__init__(name="mrc-unacked-heartbeat", daemon=True)
        self.qos = qos
        self.interval_s = interval_s
        self.stopped = threading.Event()

    def run(self) -> None:
        main = threading.main_thread()
        while not self.stopped.wait(self.interval_s) and main.is_alive():
            try:
                self.qos.refresh_held()
            except Exception as exc:  # Redis away: the next beat tries again; nothing else to do
                structlog.get_logger("mrc.transport").warning(
                    "MRC_HEARTBEAT_FAILED", error=f"{type(exc).__name__}: {exc}"
                )


_LIVE: weakref.WeakSet[QoS] = weakref.WeakSet()  # every consumer's QoS in this process


def held_by_this_process() -> list[str]:
    """The delivery tags every consumer of this process holds unacked: its deliveries in hand, the
    messages celery-batches buffers and the retries waiting out their countdown. What a process that
    must exit gives back (shared/unacked.py), so none waits for the visibility timeout."""
    return [tag for qos in list(_LIVE) for tag in qos.held_tags()]


def heartbeat_interval(visibility_timeout_s: float) -> float:
    """Four beats per visibility timeout: a beat may be late (a slow Redis, a busy interpreter) by
    three quarters of the timeout before a live consumer's message could be handed out again."""
    return min(60.0, max(0.05, visibility_timeout_s / 4))


def restore_mutex_expiry(visibility_timeout_s: float) -> int:
    """How long kombu's restore mutex lives: a worker killed while holding it (a restore takes
    milliseconds, but a kill can land in one) holds up every other worker's restores this long, on
    top of the visibility timeout its jobs already wait. A quarter of the timeout, at most a minute:
    a restore that outlives it is harmless, since each message's restore is its own WATCHed
    transaction and a second restorer cannot hand one message out twice."""
    return int(min(60.0, max(1.0, visibility_timeout_s / 4)))


class QoS(kombu_redis.QoS):
    """kombu's Redis QoS, minus the second write of records the pop script made, and with a restore
    that sets aside a record it cannot read instead of raising (which stopped every later restore).

    The visibility timeout measures silence, not age: while a consumer holds a message, a heartbeat
    thread moves its unacked record's time forward, and the restore re-reads that time inside its
    transaction. A batch that runs longer than the timeout (long generations, a slow device, retries
    waiting out their countdown) is never handed to a second worker while the first one lives; a
    dead worker's messages come back one visibility timeout after its last beat."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._heartbeat: _Heartbeat | None = None
        _LIVE.add(self)

    def append(self, message: Any, delivery_tag: str) -> None:
        recorded: set[str] = getattr(self.channel, "recorded_by_pop", set())
        if delivery_tag in recorded:
            recorded.discard(delivery_tag)
            kombu_virtual.QoS.append(self, message, delivery_tag)  # in-memory bookkeeping only
        else:  # a message taken some other way (basic_get): record it as kombu does
            super().append(message, delivery_tag)
        if self._heartbeat is None:
            self.channel.pool  # noqa: B018  # made here, not raced for by the heartbeat thread
            self._heartbeat = _Heartbeat(self, heartbeat_interval(self.visibility_timeout))
            self._heartbeat.start()

    def ack(self, delivery_tag: str) -> None:
        if not self._settle(delivery_tag):
            super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue or not self._settle(delivery_tag):
            super().reject(delivery_tag, requeue)

    def _settle(self, delivery_tag: str) -> bool:
        """kombu's ack for a message with a push id (shared/pushes.py): its unacked record goes and its
        push marker turns ACKED in one MULTI. False for one without (kombu's own ack runs instead)."""
        push_id = pushes.push_id_of(getattr(self._delivered.get(delivery_tag), "headers", None))
        if push_id is None:
            return False
        with self.pipe_or_acquire() as pipe:
            self._remove_from_indices(delivery_tag, pipe)
            pushes.mark_acked(pipe, push_id)
            pipe.execute()
        kombu_virtual.QoS.ack(self, delivery_tag)
        return True

    def _remove_from_indices(self, delivery_tag: str, pipe: Any = None) -> Any:
        """kombu's, and the record of which process popped it (shared/unacked.py)."""
        with self.pipe_or_acquire(pipe) as pipe:
            owners = names.unacked_owners_key(self.unacked_key)
            return super()._remove_from_indices(delivery_tag, pipe).hdel(owners, delivery_tag)

    def held_tags(self) -> list[str]:
        """The tags this consumer holds unacked; read from another thread, so copied with a retry."""
        for _ in range(5):
            try:
                return list(self._delivered)
            except RuntimeError:  # changed size during the copy
                continue
        return []

    def refresh_held(self) -> int:
        """Move the held messages' unacked times to now; never re-adds one acked or restored since
        (XX). Returns how many were refreshed."""
        tags = self.held_tags()
        if not tags:
            return 0
        now = time.time()
        with self.channel.conn_or_acquire() as client:
            return int(client.zadd(self.unacked_index_key, dict.fromkeys(tags, now), xx=True, ch=True))

    def stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stopped.set()

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        """kombu's, except that each message is restored only if its unacked time is still past the
        timeout when its transaction runs: a heartbeat between the listing and the restore wins."""
        self._vrestore_count += 1
        if (self._vrestore_count - 1) % (interval or 1):
            return
        with self.channel.conn_or_acquire() as client:
            ceil = time.time() - self.visibility_timeout
            try:
                with kombu_redis.Mutex(client, self.unacked_mutex_key, self.unacked_mutex_expire):
                    visible = client.zrange(
                        self.unacked_index_key, ceil, 0,
                        desc=True, byscore=True, offset=num and start, num=num, withscores=True,
                    )  # fmt: skip
                    for tag, _score in visible or []:
                        self._restore(tag, client, stale_before=ceil)
            except kombu_redis.MutexHeld:
                pass

    def restore_by_tag(self, tag: Any, client: Any = None, leftmost: bool = False) -> None:
        """A message this consumer holds, put back (a warm stop's `restore_unacked`, a requeue):
        only if this process popped it last. One frozen past the visibility timeout had its message
        handed to a second worker under the same tag, and once pushed it back from under the second
        (the job could run twice); it stays with the second now."""
        self._restore(tag, client, leftmost=leftmost, owner=process_owner())

    def _restore(
        self,
        tag: Any,
        client: Any = None,
        leftmost: bool = False,
        stale_before: float | None = None,
        owner: str | None = None,
    ) -> None:
        """kombu's restore, one WATCHed transaction per message, except for the record it cannot
        read: that one is set aside (kept for a person, its unacked record removed) and the restore
        goes on with the next. With `stale_before`, a message refreshed since then stays put; with
        `owner`, one another process popped last stays put (a record without an owner was taken
        some other way, by this process)."""
        owners = names.unacked_owners_key(self.unacked_key)

        def restore_transaction(pipe: Any) -> None:
            if owner is not None:
                popped_by = pipe.hget(owners, tag)
                if popped_by is not None and bytes_to_str(popped_by) != owner:
                    return  # handed to another worker while this one was frozen: it is theirs
            if stale_before is not None:
                score = pipe.zscore(self.unacked_index_key, tag)
                if score is not None and float(score) > stale_before:
                    return  # a heartbeat came in after the listing: its consumer lives
            raw = pipe.hget(self.unacked_key, tag)
            pipe.multi()
            self._remove_from_indices(tag, pipe)
            if raw:
                record = parse_unacked(raw)
                if record is None:
                    queue_entries.log_rejected("unacked", raw, "unacked record is not a readable message")
                    queue_entries.keep(pipe, raw)
                else:
                    payload, exchange, routing_key = record
                    self.channel._do_restore_message(payload, exchange, routing_key, pipe, leftmost)

        with self.channel.conn_or_acquire(client) as conn:
            conn.transaction(restore_transaction, self.unacked_key, self.unacked_index_key, owners)
