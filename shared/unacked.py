"""The unacked hash the transport keeps (kombu's layout: tag -> [payload, exchange, routing_key]):
its records read back, and a dying worker's messages handed back at once."""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Collection
from typing import Any

from kombu.utils import json as kombu_json
from kombu.utils.encoding import bytes_to_str

from shared import names

# KEYS[1] unacked hash, KEYS[2] its index, KEYS[3] the queue, KEYS[4] the owners; ARGV[1] the tag,
# ARGV[2] the message, ARGV[3] this process. Back to the head of its queue only if it is still unacked
# and this process popped it last (a record without an owner: taken some other way, by this process):
# never twice, never lost, never another worker's.
_GIVE_BACK_SCRIPT = """
local owner = redis.call('HGET', KEYS[4], ARGV[1])
if owner and owner ~= ARGV[3] then
  return 0
end
if redis.call('HDEL', KEYS[1], ARGV[1]) == 1 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
  redis.call('RPUSH', KEYS[3], ARGV[2])
  return 1
end
return 0
"""
_owner: tuple[int, str] | None = None


def process_owner() -> str:
    """This process, as the pop script records it beside each message it takes: host, pid and a
    random part (a pid is reused across hosts and restarts). Made again in a forked child."""
    global _owner
    if _owner is None or _owner[0] != os.getpid():
        _owner = (os.getpid(), f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}")
    return _owner[1]


def give_back(client: Any, tags: Collection[str], owner: str | None = None) -> int:
    """Put these unacked messages back at the head of their queues at once, instead of after the
    visibility timeout: for a worker about to exit because it cannot run them. By delivery tag (the
    unacked hash's key, unique per publish): a retry's countdown copy shares its job's task id, and
    another worker may hold one, which must stay where it is. Two round trips in all (a pipeline of
    reads, one of moves): the process's other threads go on until it exits, and a given-back job
    they finish meanwhile is run again elsewhere (skipped there, but a wasted delivery). Only what
    `owner` (this process) popped last: a message the visibility timeout handed to another worker
    while this one was frozen has the same tag there, and stays with it."""
    wanted = list(dict.fromkeys(tags))
    if not wanted:
        return 0
    script = client.register_script(_GIVE_BACK_SCRIPT)
    with client.pipeline(transaction=False) as pipe:
        for tag in wanted:
            pipe.hget(names.UNACKED_KEY, tag)
        records = pipe.execute()
    moves = []
    # The head of a queue is where it is popped from: the newest held goes back first, so the oldest
    # ends nearest the head and is taken first again, as it would have been.
    for tag, raw in reversed(list(zip(wanted, records, strict=True))):
        if raw is None:  # acked, restored or given back already
            continue
        try:
            payload, _exchange, routing_key = json.loads(bytes_to_str(raw))
            payload["headers"]["redelivered"] = True
        except (ValueError, TypeError, KeyError, RecursionError):
            continue  # unreadable: kombu's restore sets it aside after the visibility timeout
        # mrc's queues are bound by name (direct exchange): the routing key names the list
        queue = (
            routing_key if isinstance(routing_key, str) and routing_key else names.queue_name("interactive")
        )
        # the list of its own priority step, as kombu's restore puts it back: a backlog job of the ahead
        # list stays ahead (review, helper-107: given back to the lane's first list, behind the others)
        ahead = (payload.get("properties") or {}).get("priority") == names.AHEAD_STEP
        key = (
            names.priority_list(queue, names.AHEAD_STEP)
            if ahead and queue == names.queue_name("backlog")
            else queue
        )
        keys = [names.UNACKED_KEY, names.UNACKED_INDEX_KEY, key, names.unacked_owners_key()]
        moves.append((keys, [tag, json.dumps(payload), owner or process_owner()]))
    if not moves:
        return 0
    with client.pipeline(transaction=False) as pipe:
        for keys, args in moves:
            script(keys=keys, args=args, client=pipe)
        return sum(int(done) for done in pipe.execute())


def parse_unacked(raw: bytes | str) -> list[Any] | None:
    """An unacked record ([payload, exchange, routing_key]) as kombu's restore reads it, or None."""
    try:
        record = kombu_json.loads(bytes_to_str(raw))
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(record, list) or len(record) != 3 or not isinstance(record[0], dict):
        return None
    return record
