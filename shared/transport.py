"""kombu's Redis transport, hardened: a queue entry that is not a JSON message envelope is set aside
and logged instead of raising out of the consumer loop (which stops the whole worker: one garbage
LPUSH would take every worker on the lane down, one after another)."""

from __future__ import annotations

import json
from queue import Empty
from typing import Any

import structlog
from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str

REJECTED_KEY = "mrc:rejected"  # the last 1000 unreadable queue entries, for inspection
_KEEP_REJECTED = 1000


def parse_envelope(raw: bytes | str) -> dict[str, Any] | None:
    """The message envelope in a queue entry, or None when the entry is not one."""
    try:
        message = json.loads(bytes_to_str(raw))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(message, dict) or not isinstance(message.get("properties"), dict):
        return None
    return message


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    def _brpop_read(self, **options: Any) -> bool:
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            if not dest__item:
                raise Empty()
            dest, item = dest__item
            dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            message = parse_envelope(item)
            if message is None:
                self._set_aside(dest, item)
            else:
                self.connection._deliver(message, dest)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]
            self._flush_brpop_reauth()

    def _get(self, queue: str, timeout: Any = None) -> dict[str, Any]:
        with self.conn_or_acquire() as client:
            for pri in self.priority_steps:
                item = client.rpop(self._q_for_pri(queue, pri))
                if item:
                    self._maybe_update_queues_expire(client, queue)
                    message = parse_envelope(item)
                    if message is not None:
                        return message
                    self._set_aside(queue, item)
            self._maybe_update_queues_expire(client, queue)
            raise Empty()

    def _set_aside(self, queue: str, item: bytes | str) -> None:
        raw = item if isinstance(item, bytes) else item.encode()
        structlog.get_logger().error(
            "MRC_MESSAGE_REJECTED", queue=queue, reason="not a JSON message envelope", size=len(raw),
            preview=raw[:120].decode("utf-8", "replace"),
        )  # fmt: skip
        with self.conn_or_acquire() as client, client.pipeline() as pipe:
            pipe.lpush(REJECTED_KEY, raw)
            pipe.ltrim(REJECTED_KEY, 0, _KEEP_REJECTED - 1)
            pipe.execute()


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    Channel = Channel
