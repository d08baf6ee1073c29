"""What a queue entry of mrc's Redis transport is (shared/transport.py): the pop script that takes one
and records it unacked in one step, the envelope a readable entry holds, and what becomes of an entry
that is not one (set aside for a person, the last 1000 kept, never raised out of the consumer loop)."""

from __future__ import annotations

from typing import Any

import structlog
from kombu.utils import json as kombu_json
from kombu.utils.encoding import bytes_to_str

from shared import names

REJECTED_KEY = names.rejected_key()  # the last 1000 unreadable queue entries, for inspection
REJECTED_COUNT_KEY = names.rejected_count_key()
_KEEP_REJECTED = 1000


# KEYS[1] unacked hash, KEYS[2] unacked index, KEYS[3..] the lists in priority order; ARGV[1] now,
# ARGV[2..] "1" where the list's consumer acks (its message gets an unacked record), else "0".
# The stored entry has kombu's own layout, [payload, exchange, routing_key], so kombu's restore reads
# it; the payload is spliced in as the raw text so nothing in it is re-encoded. Returns the list, the
# entry and the tag it recorded (false if none), so Python can undo a record for an entry it rejects.
POP_SCRIPT = """
for i = 4, #KEYS do
  local item = redis.call('RPOP', KEYS[i])
  if item then
    local recorded = false
    local ok, msg = pcall(cjson.decode, item)
    if ARGV[i - 1] == '1' and ok and type(msg) == 'table' and type(msg.properties) == 'table' then
      local tag = msg.properties.delivery_tag
      local info = msg.properties.delivery_info
      if type(tag) == 'string' and type(info) == 'table' then
        local ex, rk = info.exchange, info.routing_key
        if ex == nil then ex = cjson.null end
        if rk == nil then rk = cjson.null end
        redis.call('ZADD', KEYS[2], ARGV[1], tag)
        local entry = '[' .. item .. ',' .. cjson.encode(ex) .. ',' .. cjson.encode(rk) .. ']'
        redis.call('HSET', KEYS[1], tag, entry)
        redis.call('HSET', KEYS[3], tag, ARGV[2])
        recorded = tag
      end
    end
    return {KEYS[i], item, recorded}
  end
end
return false
"""


def parse_envelope(raw: bytes | str) -> dict[str, Any] | None:
    """The message envelope in a queue entry, or None when the entry is not one. kombu's loader:
    typed values (datetime, UUID, Decimal) in headers come back typed, as kombu delivers them."""
    try:
        message = kombu_json.loads(bytes_to_str(raw))
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(message, dict) or not isinstance(message.get("properties"), dict):
        return None
    return message


def log_rejected(queue: str, item: bytes | str, reason: str) -> None:
    raw = item if isinstance(item, bytes) else item.encode()
    structlog.get_logger().error(
        "MRC_MESSAGE_REJECTED", queue=queue, reason=reason, size=len(raw),
        preview=raw[:120].decode("utf-8", "replace"),
    )  # fmt: skip


def keep(pipe: Any, raw: bytes | str) -> None:
    """Queue the write of an unreadable entry to the rejected list (the last 1000 are kept)."""
    pipe.lpush(REJECTED_KEY, raw)
    pipe.ltrim(REJECTED_KEY, 0, _KEEP_REJECTED - 1)
    pipe.incr(REJECTED_COUNT_KEY)  # the list stays at 1000 once full: the count goes on (helper-101)


def set_aside(client: Any, queue: str, item: bytes | str, reason: str, tag: str | None = None) -> None:
    """Keep an unreadable entry for a person (the last 1000) and drop any unacked record of it."""
    raw = item if isinstance(item, bytes) else item.encode()
    log_rejected(queue, raw, reason)
    with client.pipeline() as pipe:  # MULTI/EXEC: kept and unrecorded together
        keep(pipe, raw)
        if tag is not None:
            pipe.hdel(names.UNACKED_KEY, tag)
            pipe.zrem(names.UNACKED_INDEX_KEY, tag)
            pipe.hdel(names.unacked_owners_key(), tag)
        pipe.execute()
