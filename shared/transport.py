"""kombu's Redis transport, made at-least-once and hardened.

At least once: stock kombu consumes with BRPOP, so a message leaves its list the moment Redis sends
the reply, and reaches the unacked hash (from which a dead worker's messages are restored) only once
the worker has read that reply. A worker killed in between loses the message, and the window is wide:
with the solo pool a BRPOP stays outstanding while a part-full batch runs, so any message that arrives
during the batch sits in the dead worker's socket buffer. Here a Lua script pops the message and
writes it to the unacked hash in one step; a message is always in a list or in the unacked hash.
Lua cannot block, so when the lists are empty the channel waits on the first (interactive) list with
a BLMOVE that moves nothing (tail to tail of the same list), for at most `idle_wait_s`.

Hardened: a queue entry that is not a JSON message envelope is set aside and logged instead of raising
out of the consumer loop (which stops the whole worker: one garbage LPUSH would take every worker on
the lane down, one after another). Redis's Lua JSON decoder accepts entries Python's does not (`0x10`,
`inf`, `nan`, leading zeros), so the script may have recorded such an entry as unacked: setting it
aside removes that record, and a restore skips (and sets aside) any record it cannot read instead of
stopping, so one bad entry never keeps a dead worker's jobs from coming back.

As kombu does: an unacked record is written only for consumers that ack (`no_ack` consumers and
`ack_emulation=False` get none), and messages are decoded with kombu's JSON loader (typed header
values such as datetimes and UUIDs come back typed). What differs from kombu on purpose is listed,
with the reason, in tests/kombu/expected_differences.txt, which `make test-kombu` keeps true.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from queue import Empty
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils import json as kombu_json
from kombu.utils.encoding import bytes_to_str

from shared import logs, names, pushes, queue_entries, redis_target, unacked
from shared.errors import NotReplicated
from shared.transport_qos import QoS

# Called at every poll of a consumer's channel (the worker's liveness: an idle consumer polls every
# `Channel.idle_wait_s`); None outside a worker.
on_poll: Callable[[], None] | None = None

# Most messages a consumer holds unacked per queue name (absent: no limit beyond the prefetch). The
# worker keeps the backlog below its prefetch so room for a ticket is always left: with every slot
# held by backlog work, a ticket would wait in Redis until a whole backlog delivery finished.
lane_limits: dict[str, int] = {}
IDLE_KEY = f"{names.REDIS_PREFIX}idle"  # never written: a consumer with no queue open blocks on it
# Replies that refuse a pop until Redis is whole again, besides OOM (out of memory under `noeviction`,
# redis-py's OutOfMemoryError): BUSY, a script running long; the rest a failover's, which Sentinel
# connections already turn into a reconnect.
REFUSALS_FOR_NOW = ("BUSY ", "TRYAGAIN", *redis_target.TRANSIENT_REPLIES)
REFUSED_PAUSE_S = 1.0


class _Taking:
    """Whether this process's consumers take messages: a worker about to exit stops them before it
    gives back what it holds, or a pop would take a message given back a moment before into a
    process that is ending (seen: 7 of 10 messages taken again between the give-back and the exit).
    The lock covers a reply's check through its delivery into the QoS's books, and `stop` waits (a
    bounded time) for the pops already sent: once it returns, every message taken is in those books
    (and is given back) or was given back by its reply (a pop sent just before the stop, whose reply
    the exit would otherwise have left unread, its message in the unacked hash until the timeout)."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.on = True
        self.in_flight = 0  # pops sent whose replies are not read yet

    def begin_pop(self) -> bool:
        """Whether a pop may be sent now (then it counts as in flight until `end_pop`)."""
        with self.lock:
            if self.on:
                self.in_flight += 1
            return self.on

    def end_pop(self) -> None:
        with self.lock:
            self.in_flight -= 1
            self.lock.notify_all()

    def stop(self, wait_s: float = 2.0) -> None:
        with self.lock:
            self.on = False
            self.lock.wait_for(lambda: self.in_flight <= 0, wait_s)


taking = _Taking()


def stop_taking() -> None:
    taking.stop()


class Channel(kombu_redis.Channel):
    #: How long an idle consumer blocks before it looks at every list again. An interactive message
    #: wakes it at once; a backlog message waits at most this long.
    idle_wait_s = 0.2
    QoS = QoS
    #: MRC_REDIS_WAIT_REPLICAS / _TIMEOUT_MS (0: a publish returns without waiting; acks never wait).
    wait_replicas = 0
    wait_timeout_ms = 1000
    from_transport_options = (  # type: ignore[assignment]  # kombu's declared tuple, two names longer
        *kombu_redis.Channel.from_transport_options,
        "wait_replicas",
        "wait_timeout_ms",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.global_keyprefix:
            raise ValueError("mrc's Redis transport does not support global_keyprefix")
        self._waiting = False  # the command in flight is the idle wait, not a pop
        self._refused_since: float | None = None  # when Redis began refusing pops (REFUSALS_FOR_NOW)
        self.recorded_by_pop: set[str] = set()  # tags the pop script recorded as unacked
        self._no_ack_queues: set[str] = set()
        self._captured: list[tuple[str, str]] | None = None
        self._tables: dict[str, Any] | None = None

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[tuple[str, str]]]:
        """Publishes in this block are encoded exactly as kombu sends them, but not sent: each becomes
        (list key, message text) for the caller to push itself, e.g. in one Lua step with its job's
        record (`mrc backlog`: a job is queued and recorded together, or neither). The exchange's
        bindings are read once per block instead of once per message."""
        if self._captured is not None:  # a second capture would end the first's: its messages sent
            raise RuntimeError("this channel is already capturing (one capture at a time per channel)")
        captured: list[tuple[str, str]] = []
        self._captured, self._tables = captured, {}
        try:
            yield captured
        finally:
            self._captured, self._tables = None, None

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        if self._captured is not None:
            pri = self._get_message_priority(message, reverse=False)
            self._captured.append((self._q_for_pri(queue, pri), kombu_json.dumps(message)))
            return
        push_id = pushes.push_id_of(message.get("headers"))
        if "_publish_batch" in kwargs or (push_id is None and self.wait_replicas == 0):
            super()._put(queue, message, **kwargs)
            return
        self._put_once(queue, message, push_id)

    def _put_once(self, queue: str, message: Any, push_id: str | None) -> None:
        """mrc's own publishes: pushed once per push id (whoever retries the call: redis-py after a
        timeout, Celery after a lost connection, the push lands once), then, with the durability knob
        (MRC_REDIS_WAIT_REPLICAS), a WAIT on the same connection. Fewer replicas in time raises
        NotReplicated: the message is queued on the master, not yet on its replicas; the caller says
        so (it is not "nothing enqueued") and a resubmission under the same job id is the same job."""
        key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
        self.push_text(queue, key, kombu_json.dumps(message), push_id)

    def push_text(self, queue: str, key: str, text: str, push_id: str | None) -> None:
        """A message already encoded (a capture's, or one made from its template: producer/queue/
        templates.py) pushed as a publish of it is: once per push id, then the WAIT."""
        with self.conn_or_acquire() as client, client.pipeline(transaction=False) as pipe:
            if push_id is None:
                pipe.lpush(key, text)
            else:  # EVAL, not a registered script: no SCRIPT EXISTS round trip per publish
                pipe.eval(pushes.PUSH_ONCE_SCRIPT, 2, key, names.push_key(push_id), text, pushes.HELD_TTL_MS)
            if self._expires and queue in self._expires:
                for pri in self.priority_steps:
                    pipe.pexpire(self._q_for_pri(queue, pri), self._expires[queue])
            if self.wait_replicas > 0:
                pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            replies = pipe.execute()
        if self.wait_replicas > 0 and int(replies[-1]) < self.wait_replicas:
            raise NotReplicated(int(replies[-1]), self.wait_replicas, self.wait_timeout_ms)

    def get_table(self, exchange: str) -> Any:
        if self._tables is None:
            return super().get_table(exchange)
        if exchange not in self._tables:
            self._tables[exchange] = super().get_table(exchange)
        return self._tables[exchange]

    def close(self) -> None:
        if self._qos is not None:
            self._qos.stop_heartbeat()
        super().close()

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        (self._no_ack_queues.add if no_ack else self._no_ack_queues.discard)(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)

    def _records(self, queue: str) -> bool:
        """Whether kombu would keep an unacked record for a message taken from `queue`: only for a
        consumer that acks, and only with ack emulation on."""
        return bool(self.ack_emulation) and queue not in self._no_ack_queues

    def _brpop_start(self, timeout: float | None = None) -> None:
        if on_poll is not None:
            on_poll()
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        queues = self._open_queues(queues) if taking.on else []
        if not queues:  # every lane at its limit: wait a little, then look again (never a busy loop)
            self.client.connection.send_command(
                "BLMOVE", IDLE_KEY, IDLE_KEY, "RIGHT", "RIGHT", self.idle_wait_s
            )
            self._waiting = True
            self._in_poll = self.client.connection
            self._brpop_sent_at = kombu_redis.monotonic()  # type: ignore[attr-defined,assignment]  # its module global
            return
        # kombu's order (each queue's first list, then each one's next: interactive before backlog at
        # every rank), but the backlog's ahead list taken before its first (shared/names.py).
        order = {queue: names.pop_steps(queue, self.priority_steps) for queue in queues}
        pairs = [(self._q_for_pri(queue, order[queue][rank]), queue)
                 for rank in range(len(self.priority_steps)) for queue in queues]  # fmt: skip
        keys = [key for key, _ in pairs]
        flags = ["1" if self._records(queue) else "0" for _, queue in pairs]
        connection = self.client.connection
        if self._waiting or not taking.begin_pop():  # the idle wait replaces kombu's 1 s BRPOP timeout
            self._waiting = True  # (and a process that stopped taking only waits)
            first = self._q_for_pri(queues[0], 0)  # not the ahead list (a backlog-only worker's keys[0])
            connection.send_command("BLMOVE", first, first, "RIGHT", "RIGHT", self.idle_wait_s)
        else:
            records = [self.unacked_key, self.unacked_index_key, names.unacked_owners_key(self.unacked_key)]
            owner = unacked.process_owner()
            try:
                connection.send_command(
                    "EVAL",
                    queue_entries.POP_SCRIPT,
                    len(keys) + 3,
                    *records,
                    *keys,
                    time.time(),
                    owner,
                    *flags,
                )
            except BaseException:
                taking.end_pop()
                raise
        self._in_poll = connection
        # kombu's clock, the one its health check reads: one clock for both ends of the comparison (with
        # time.monotonic here, kombu's tests, which patch its clock, passed or failed by the machine's
        # uptime).
        self._brpop_sent_at = kombu_redis.monotonic()  # type: ignore[attr-defined,assignment]  # its module global

    def _open_queues(self, queues: list[str]) -> list[str]:
        """The queues this consumer may take from now: those under their lane limit."""
        if not lane_limits:
            return queues
        held: dict[str, int] = {}
        dirty: set[str] = getattr(self.qos, "_dirty", set())
        for tag, message in list(getattr(self.qos, "_delivered", {}).items()):
            # A retry waiting out its countdown holds no delivery's place (tasks.Batches keeps it out
            # of the prefetch too): counted, as many as the lane's limit closed the lane until the
            # first ran (review: fresh backlog jobs waited 19 s behind four retries).
            if tag not in dirty and not (getattr(message, "headers", None) or {}).get("eta"):
                queue = str((getattr(message, "delivery_info", None) or {}).get("routing_key", ""))
                held[queue] = held.get(queue, 0) + 1
        return [q for q in queues if held.get(q, 0) < lane_limits.get(q, 1 << 30)]

    def _brpop_read(self, **options: Any) -> bool:
        waiting, self._waiting = self._waiting, False
        try:
            try:
                reply = self.client.parse_response(
                    self.client.connection, "BLMOVE" if waiting else "EVAL", **options
                )
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            except redis.ResponseError as exc:
                if not (isinstance(exc, redis.OutOfMemoryError) or str(exc).startswith(REFUSALS_FOR_NOW)):
                    raise
                self._refused(exc)
                raise Empty() from None
            if waiting:
                self._refused_since = None  # the wait (a write Redis refuses under OOM) was taken
                raise Empty()  # woken (or timed out): the next command pops
            if not reply:  # the pop found nothing, which proves nothing of writes: the spell goes on
                self._waiting = True  # (review: it ended here, and OOM was logged every second)
                raise Empty()
            self._refused_since = None
            dest, item, recorded = reply
            dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            tag = bytes_to_str(recorded) if recorded else None
            self._queue_cycle.rotate(dest)
            message = queue_entries.parse_envelope(item)
            if message is None:
                with self.conn_or_acquire() as client:
                    queue_entries.set_aside(client, dest, item, "not a JSON message envelope", tag)
            else:
                with taking.lock:
                    if not taking.on and tag is not None:  # taken as the process stops: back at once
                        with self.conn_or_acquire() as client:
                            unacked.give_back(client, [tag])
                        raise Empty()
                    if tag is not None:
                        self.recorded_by_pop.add(tag)
                    self.connection._deliver(message, dest)
            return True
        finally:
            if not waiting:
                taking.end_pop()
            self._in_poll = None  # type: ignore[assignment]  # kombu declares it otherwise
            self._flush_brpop_reauth()

    def _refused(self, exc: redis.ResponseError) -> None:
        """Redis refused the pop for now (out of memory under `noeviction`, a failover's replies without
        Sentinel): said once per spell, and the next pop a second later. It reached kombu as a plain
        error, and an idle worker exited 1 at once, to reload its model and exit again (review)."""
        if self._refused_since is None:
            self._refused_since = time.monotonic()
            logs.get_logger().warning("MRC_BROKER_REFUSED", error=redis_target.refusal_words(exc)[:200])
        time.sleep(REFUSED_PAUSE_S)

    def _get(self, queue: str, timeout: Any = None) -> dict[str, Any]:
        with self.conn_or_acquire() as client:
            for pri in names.pop_steps(queue, self.priority_steps):
                item = client.rpop(self._q_for_pri(queue, pri))
                if item:
                    self._maybe_update_queues_expire(client, queue)
                    message = queue_entries.parse_envelope(item)
                    if message is not None:
                        return message
                    queue_entries.set_aside(client, queue, item, "not a JSON message envelope")
            self._maybe_update_queues_expire(client, queue)
            raise Empty()


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """The same channel over a master found through Sentinel (MRC_REDIS_SENTINELS): every connection
    the pool opens asks the Sentinels for the master first, and one that finds a demoted master
    (READONLY), a master in the middle of a failover (NOREPLICAS...) or a dead one fails and
    reconnects, so the pop script, the unacked hash, the heartbeat and `give_back` follow a failover.

    kombu's SentinelChannel with our Channel in front of it: its fanout and bookkeeping are kept, and a
    `sentinel://h1:p1;sentinel://h2:p2` broker URL works as it does in kombu. With the `sentinels`
    option (how mrc's settings arrive) the pool is mrc's (shared/redis_target.py): connections that
    re-ask the Sentinels at every reconnect, and the failover logged and counted like every client's."""

    sentinels: tuple[tuple[str, int], ...] = ()
    from_transport_options = (  # type: ignore[assignment]
        *kombu_redis.SentinelChannel.from_transport_options,
        "wait_replicas",
        "wait_timeout_ms",
        "sentinels",
    )

    def _connparams(self, asynchronous: bool = False) -> Any:
        if self.sentinels:  # the async consumer's connection class is derived from these
            self.connection_class = redis_target.FailoverConnection
            self.connection_class_ssl = redis_target.FailoverSSLConnection  # type: ignore[assignment]
        return super()._connparams(asynchronous)

    def _sentinel_managed_pool(self, asynchronous: bool = False) -> Any:
        if not self.sentinels:
            return super()._sentinel_managed_pool(asynchronous)
        params = self._connparams(asynchronous)
        params.pop("host", None)
        params.pop("port", None)
        addresses = [(str(host), int(port)) for host, port in self.sentinels]
        master = getattr(self, "master_name", None) or "mymaster"  # transport options, set by kombu
        kwargs = dict(getattr(self, "sentinel_kwargs", None) or {})
        return redis_target.pool_for(addresses, master, kwargs, **params)


class SentinelTransport(Transport):
    Channel = SentinelChannel
    default_port = 26379  # type: ignore[assignment]  # kombu's Sentinel transport's
