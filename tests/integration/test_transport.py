"""The broker transport against a real redis-server: a message is always in a list or in the unacked
hash, so a consumer that dies at any moment loses nothing, and the idle wait keeps FIFO order."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from kombu import Connection, Consumer, Exchange, Producer, Queue
from structlog.testing import capture_logs

from scripts import devservices as services
from shared import celery_app, names, pushes

pytestmark = pytest.mark.integration

HOUR_MS = 3_600_000
QUEUE = Queue("mrc.t", Exchange("mrc.t", type="direct"), routing_key="mrc.t")


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    service = services.start_redis(tmp_path)
    yield service.url
    service.stop()


def _connect(url: str, stock: bool = False) -> Connection:
    transport = "redis" if stock else "shared.transport:Transport"
    return Connection(url, transport=transport, transport_options={"visibility_timeout": 1})


def _publish(url: str, *bodies: dict[str, Any]) -> None:
    with _connect(url) as conn:
        producer = Producer(conn.channel())
        for body in bodies:
            producer.publish(body, exchange=QUEUE.exchange, routing_key="mrc.t", declare=[QUEUE],
                             serializer="json")  # fmt: skip


def _pop_without_reading(url: str, stock: bool) -> Any:
    """A consumer sends its pop, and 'dies' before it reads the reply; returns its channel."""
    channel = _connect(url, stock).channel()
    Consumer(channel, [QUEUE], accept=["json"], callbacks=[lambda body, message: None]).consume()
    channel.connection.cycle.on_poll_start()  # sends the pop, as the worker's event loop does
    client = redis_lib.Redis.from_url(url)
    deadline = time.monotonic() + 30
    while client.llen("mrc.t") and time.monotonic() < deadline:  # served: the reply sits in the socket
        time.sleep(0.01)
    return channel


def _where(client: redis_lib.Redis) -> tuple[int, int]:
    return int(client.llen("mrc.t")), int(client.hlen("unacked"))


def test_stock_kombu_loses_a_message_popped_by_a_consumer_that_dies(redis_url: str) -> None:
    """Why the transport exists: with BRPOP the message is in neither place."""
    client = redis_lib.Redis.from_url(redis_url)
    _publish(redis_url, {"n": 1})
    channel = _pop_without_reading(redis_url, stock=True)
    assert _where(client) == (0, 0)
    channel.client.connection.disconnect()


def test_a_message_popped_by_a_consumer_that_dies_is_restored(redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    _publish(redis_url, {"n": 1})
    dead = _pop_without_reading(redis_url, stock=False)
    assert _where(client) == (0, 1), "popped and recorded as unacked in one step"
    dead.client.connection.disconnect()  # the socket closes without a read, as on SIGKILL
    stored = json.loads(next(iter(client.hvals("unacked"))))
    assert stored[1:] == ["mrc.t", "mrc.t"], "kombu's own layout: [payload, exchange, routing key]"

    time.sleep(1.2)  # past the visibility timeout
    received: list[dict[str, Any]] = []
    with _connect(redis_url) as conn:
        channel = conn.channel()
        channel.qos.restore_visible(num=10, interval=1)
        assert _where(client) == (1, 0)
        callback = lambda body, message: (received.append(body), message.ack())  # noqa: E731 - a one-line callback
        with Consumer(channel, [QUEUE], accept=["json"], callbacks=[callback]):
            conn.drain_events(timeout=5)
    assert received == [{"n": 1}]
    assert _where(client) == (0, 0), "acked: gone from the unacked hash"
    assert client.hlen(names.unacked_owners_key()) == 0, "acked: its owner record gone too"


def test_a_push_marker_lives_while_its_message_waits_and_says_acked_after(redis_url: str) -> None:
    """shared/pushes.py: the marker of a publish with a push id says pushed while its message waits or
    is held, and acked (for an hour more) once acked or rejected. Before, it lived an hour whatever
    its message did: a message waiting longer lost the mark that keeps it from being pushed twice."""
    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    pushes_ = ("p-ack", "p-reject")
    with _connect(redis_url) as conn:
        producer = Producer(conn.channel())
        for n, push_id in enumerate(pushes_):
            producer.publish({"n": n}, exchange=QUEUE.exchange, routing_key="mrc.t", declare=[QUEUE],
                             serializer="json", headers={names.PUSH_HEADER: push_id})  # fmt: skip

    def markers() -> list[tuple[str | None, int]]:
        return [(client.get(names.push_key(p)), int(client.pttl(names.push_key(p)))) for p in pushes_]

    assert all(value == pushes.HELD and ttl > 24 * HOUR_MS for value, ttl in markers())
    held: list[Any] = []
    conn = _connect(redis_url)
    with conn, Consumer(conn.channel(), [QUEUE], accept=["json"], callbacks=[lambda _b, m: held.append(m)]):
        deadline = time.monotonic() + 10
        while len(held) < 2 and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=1)
        assert _where(client) == (0, 2)
        assert all(value == pushes.HELD and ttl > 24 * HOUR_MS for value, ttl in markers())
        held[0].ack()
        held[1].reject()
    assert _where(client) == (0, 0)
    assert all(value == pushes.ACKED and 0 < ttl <= HOUR_MS for value, ttl in markers()), markers()


def test_an_idle_consumer_wakes_for_new_messages_and_keeps_their_order(redis_url: str) -> None:
    received: list[int] = []
    with _connect(redis_url) as conn:
        channel = conn.channel()
        callback = lambda body, message: (received.append(body["n"]), message.ack())  # noqa: E731 - a one-line callback
        with Consumer(channel, [QUEUE], accept=["json"], callbacks=[callback]):
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.5)  # empty: the channel alternates pop and idle wait
            _publish(redis_url, *({"n": n} for n in range(5)))
            deadline = time.monotonic() + 10
            while len(received) < 5 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
    assert received == [0, 1, 2, 3, 4]


def test_a_redis_out_of_memory_is_waited_out_not_raised(redis_url: str) -> None:
    """Review: Redis refusing the pop (`OOM`, under `noeviction`) reached kombu as a plain error and an
    idle worker exited 1 at once, to reload its model and exit again while Redis stayed full."""
    received: list[int] = []
    client = redis_lib.Redis.from_url(redis_url)
    with _connect(redis_url) as conn:
        channel = conn.channel()
        callback = lambda body, message: (received.append(body["n"]), message.ack())  # noqa: E731 - a one-line callback
        with Consumer(channel, [QUEUE], accept=["json"], callbacks=[callback]):
            client.config_set("maxmemory", 1)  # the idle wait (BLMOVE) is a write Redis refuses now
            try:
                with capture_logs() as logged, pytest.raises(TimeoutError):
                    conn.drain_events(timeout=3.5)
            finally:
                client.config_set("maxmemory", 0)
            # Said once for the spell, in Redis's words with the OOM redis-py takes off (review: every
            # second, an empty pop between refused waits ending the spell; no "OOM" to search for)
            refused = [e for e in logged if e["event"] == "MRC_BROKER_REFUSED"]
            assert len(refused) == 1, refused
            assert refused[0]["error"].startswith("OOM ")
            _publish(redis_url, *({"n": n} for n in range(3)))
            deadline = time.monotonic() + 10
            while len(received) < 3 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
    assert received == [0, 1, 2]
    assert _where(client) == (0, 0)


@contextlib.contextmanager
def _consuming(redis_url: str, count: int) -> Iterator[tuple[Connection, Any, list[Any]]]:
    """A consumer (prefetch 4) that has taken `count` messages and holds them unacked."""
    taken: list[Any] = []
    with _connect(redis_url) as conn:
        channel = conn.channel()
        channel.basic_qos(prefetch_count=4)
        callback = lambda body, message: taken.append(message)  # noqa: E731 - a one-line callback
        with Consumer(channel, [QUEUE], accept=["json"], callbacks=[callback]):
            deadline = time.monotonic() + 10
            while len(taken) < count and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
            yield conn, channel, taken


def test_give_back_returns_a_dying_workers_messages_at_once(redis_url: str) -> None:
    """A worker that cannot go on (device lost) puts the messages it holds back at the head of the
    queue instead of leaving them to the visibility timeout, by delivery tag: a second message with
    the same task id (a retry's countdown copy, held elsewhere) stays put, as do other messages."""
    from shared.unacked import give_back

    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    with _connect(redis_url) as conn:
        producer = Producer(conn.channel())
        for n, task_id in enumerate(["job-0", "job-1", "job-2", "job-0"]):
            producer.publish({"n": n}, exchange=QUEUE.exchange, routing_key="mrc.t", declare=[QUEUE],
                             serializer="json", headers={"id": task_id})  # fmt: skip
    with _consuming(redis_url, 4) as (_conn, _channel, taken):
        assert _where(client) == (0, 4)
        by_n = {message.payload["n"]: message.delivery_tag for message in taken}
        assert give_back(client, [by_n[0], by_n[2], "not-here"]) == 2
        assert _where(client) == (2, 2)
        assert int(client.zcard("unacked_index")) == 2
        assert give_back(client, [by_n[0]]) == 0, "given back once, never twice"
        returned = [json.loads(raw) for raw in client.lrange("mrc.t", 0, -1)]
        assert sorted(r["headers"]["id"] for r in returned) == ["job-0", "job-2"]
        assert all(r["headers"]["redelivered"] for r in returned)
        held = [json.loads(raw)[0]["headers"]["id"] for raw in client.hvals("unacked")]
        assert sorted(held) == ["job-0", "job-1"], "the copy with the same task id was given back too"


@contextlib.contextmanager
def _handed_over(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, Any, Any]]:
    """Worker A takes a message and freezes past the visibility timeout; the restore hands it to
    worker B under the same delivery tag. Yields (A's message, A's channel, B's message, B's
    channel) with this process being A (`shared.unacked._owner`; B's is set while it pops)."""
    import os

    from shared import unacked

    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    owners = names.unacked_owners_key()
    _publish(redis_url, {"n": 0})
    monkeypatch.setattr(unacked, "_owner", (os.getpid(), "worker-a"))
    with _consuming(redis_url, 1) as (_conn, channel, taken):
        assert client.hget(owners, taken[0].delivery_tag) == "worker-a"
        channel.qos.stop_heartbeat()  # frozen: no beat keeps its record fresh
        time.sleep(1.2)  # past the visibility timeout (1 s)
        channel.qos.restore_visible(num=10, interval=1)
        assert _where(client) == (1, 0)
        assert client.hlen(owners) == 0, "restored: the owner record goes with the unacked one"
        monkeypatch.setattr(unacked, "_owner", (os.getpid(), "worker-b"))
        with _consuming(redis_url, 1) as (_conn_b, channel_b, taken_b):
            assert taken_b[0].delivery_tag == taken[0].delivery_tag
            assert client.hget(owners, taken_b[0].delivery_tag) == "worker-b"
            monkeypatch.setattr(unacked, "_owner", (os.getpid(), "worker-a"))  # A wakes
            yield taken[0], channel, taken_b[0], channel_b
            monkeypatch.setattr(unacked, "_owner", (os.getpid(), "worker-b"))  # B's own stop


def test_a_message_handed_to_another_worker_while_this_one_was_frozen_stays_with_it(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left open by the eleventh session: a worker frozen past the visibility timeout had its message
    handed to a second worker under the same delivery tag, and, waking to a device fault, gave it
    back from under the second (the job could run twice). The pop records which process took each
    message last; a give-back moves only this process's."""
    from shared import unacked

    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    with _handed_over(redis_url, monkeypatch) as (mine, _channel, _theirs, _channel_b):
        tag = mine.delivery_tag
        assert unacked.give_back(client, [tag]) == 0
        assert _where(client) == (0, 1), "the frozen worker took its message from the second"
        assert unacked.give_back(client, [tag], owner="worker-b") == 1  # the second's own
        assert _where(client) == (1, 0)
        assert client.hlen(names.unacked_owners_key()) == 0


@pytest.mark.parametrize("how", ["warm stop", "requeue"])
def test_a_frozen_worker_that_wakes_and_restores_leaves_the_second_workers_message(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Left open by the twelfth session: the frozen worker, waking and stopping warm (kombu's
    `restore_unacked`) or requeueing the message (`reject(requeue=True)`), pushed back the message a
    second worker held under the same tag and deleted that worker's records: the job could run
    twice. A restore of this consumer's own moves only what this process popped last."""
    import os

    from shared import unacked

    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    with _handed_over(redis_url, monkeypatch) as (mine, channel, theirs, channel_b):
        if how == "warm stop":
            channel.qos.restore_unacked()
        else:
            mine.requeue()
        assert _where(client) == (0, 1), "the woken worker took its message from the second"
        assert client.hget(names.unacked_owners_key(), theirs.delivery_tag) == "worker-b"
        assert channel_b.qos.refresh_held() == 1, "the second's unacked time is still kept"
        monkeypatch.setattr(unacked, "_owner", (os.getpid(), "worker-b"))
        theirs.requeue()  # the second's own requeue still works
        assert _where(client) == (1, 0)
        assert client.hlen(names.unacked_owners_key()) == 0


def test_a_pop_sent_as_the_worker_stops_taking_is_given_back_not_stranded(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: the consumer's next pop, sent just before a fatal error stopped it taking and
    served by Redis (its message in the unacked hash), was never read before the exit: the message
    waited for the visibility timeout. `stop_taking` now waits for the pops in flight, whose replies
    give their messages straight back; then what the process holds is given back."""
    import threading

    from shared import transport, transport_qos
    from shared.unacked import give_back

    monkeypatch.setattr(transport, "taking", transport._Taking())  # this test's stop ends with it
    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    _publish(redis_url, {"n": 0}, {"n": 1})
    with _consuming(redis_url, 1) as (conn, channel, taken):
        assert len(taken) == 1
        channel.connection.cycle.on_poll_start()  # the next pop: sent, its reply not read
        deadline = time.monotonic() + 10
        while client.llen("mrc.t") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _where(client) == (0, 2)  # both in the unacked hash, one of them in no one's books

        exited = threading.Event()  # os._exit: after it, nothing reads a reply

        def event_loop() -> None:  # the worker's main thread, reading the reply a moment later
            time.sleep(0.3)
            if not exited.is_set():
                with contextlib.suppress(Exception):
                    conn.drain_events(timeout=2)

        reader = threading.Thread(target=event_loop)
        reader.start()
        transport.stop_taking()
        assert give_back(client, transport_qos.held_by_this_process()) == 1
        exited.set()
        reader.join(10)
        assert _where(client) == (2, 0), "a message taken as the worker stopped waits for the timeout"
        assert len(taken) == 1


def test_no_ack_consumers_get_no_unacked_record_and_no_redelivery(redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    _publish(redis_url, {"n": 1})
    received: list[Any] = []
    with _connect(redis_url) as conn:
        channel = conn.channel()
        with Consumer(
            channel, [QUEUE], accept=["json"], no_ack=True, callbacks=[lambda b, m: received.append(b)]
        ):
            conn.drain_events(timeout=5)
        assert received == [{"n": 1}]
        assert _where(client) == (0, 0), "kombu keeps no record for a no_ack consumer: neither do we"
        time.sleep(1.2)  # past the visibility timeout: nothing to hand out again
        channel.qos.restore_visible(num=10, interval=1)
        assert _where(client) == (0, 0)


def test_typed_header_values_come_back_typed(redis_url: str) -> None:
    import datetime
    import uuid as uuid_lib
    from decimal import Decimal

    sent = {
        "when": datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC),
        "ref": uuid_lib.UUID("12345678-1234-5678-1234-567812345678"),
        "amount": Decimal("12.50"),
    }
    with _connect(redis_url) as conn:
        Producer(conn.channel()).publish({"n": 1}, exchange=QUEUE.exchange, routing_key="mrc.t",
                                         declare=[QUEUE], serializer="json", headers=sent)  # fmt: skip
    got: list[Any] = []
    with _connect(redis_url) as conn:
        channel = conn.channel()
        callback = lambda body, message: (got.append(message.headers), message.ack())  # noqa: E731 - a one-line callback
        with Consumer(channel, [QUEUE], accept=["json"], callbacks=[callback]):
            conn.drain_events(timeout=5)
    assert {key: got[0][key] for key in sent} == sent


def _hold(conn: Connection) -> tuple[Any, list[Any]]:
    """Consume from QUEUE and hold every message unacked; returns the channel and the messages."""
    held: list[Any] = []
    channel = conn.channel()
    channel.basic_qos(prefetch_count=10)
    Consumer(channel, [QUEUE], accept=["json"], callbacks=[lambda b, m: held.append(m)]).consume()
    deadline = time.monotonic() + 10
    while not held and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=1)
    assert held, "nothing delivered"
    return channel, held


def test_a_live_consumer_keeps_a_message_past_the_visibility_timeout(redis_url: str) -> None:
    """The timeout measures silence, not age: a batch that runs longer than it is not handed to a
    second worker while the first one lives; once the holder stops beating, it comes back."""
    client = redis_lib.Redis.from_url(redis_url)
    _publish(redis_url, {"n": 1})
    holder = _connect(redis_url)
    channel, held = _hold(holder)
    with _connect(redis_url) as other:
        restorer = other.channel()
        for _ in range(6):  # 3 s: three visibility timeouts
            time.sleep(0.5)
            restorer.qos.restore_visible(num=10, interval=1)
            assert _where(client) == (0, 1), "restored from a live consumer"
        channel.qos.stop_heartbeat()  # the holder hangs, or its process is gone
        time.sleep(1.3)
        restorer.qos.restore_visible(num=10, interval=1)
        assert _where(client) == (1, 0), "a silent holder's message comes back after the timeout"
    assert held[0].payload == {"n": 1}
    channel.close()
    holder.release()


def test_a_heartbeat_after_the_listing_wins_over_the_restore(redis_url: str) -> None:
    """The restore re-reads the unacked time inside its transaction: a message listed as stale but
    refreshed before its turn stays with its consumer."""
    client = redis_lib.Redis.from_url(redis_url)
    _publish(redis_url, {"n": 1})
    dead = _pop_without_reading(redis_url, stock=False)
    dead.client.connection.disconnect()
    (tag,) = [t.decode() for t in client.hkeys("unacked")]
    with _connect(redis_url) as conn:
        qos = conn.channel().qos
        listed_at = time.time() - 1  # as if listed a second ago with the timeout run out
        client.zadd("unacked_index", {tag: time.time()})  # the beat that came in since
        qos._restore(tag, stale_before=listed_at)
        assert _where(client) == (0, 1)
        qos._restore(tag, stale_before=time.time() + 1)
        assert _where(client) == (1, 0)


def test_a_restorer_killed_holding_the_mutex_holds_up_restores_a_quarter_of_the_timeout(
    redis_url: str, tmp_path: Path
) -> None:
    """A worker killed inside its restore leaves kombu's restore mutex behind: nobody restores until
    it expires. The worker's own options keep that to a quarter of the visibility timeout (at least a
    second), not the minute that once kept a killed worker's jobs away for 12 timeouts of 5 s."""
    env = services.base_env(redis_url, "http://127.0.0.1:9", "bkt", tmp_path)
    env.update({"MRC_VISIBILITY_TIMEOUT_S": "2", "MRC_RETRY_BASE_S": "0.2", "MRC_RETRY_MAX_S": "1"})
    options = celery_app.make_celery(services.settings_from_env(env)).conf.broker_transport_options
    assert options["unacked_mutex_expire"] == 1
    client = redis_lib.Redis.from_url(redis_url)
    _publish(redis_url, {"n": 1})
    dead = _pop_without_reading(redis_url, stock=False)
    dead.client.connection.disconnect()
    # the dead restorer's lock, taken as kombu's Mutex takes it, and never released
    assert client.lock("unacked_mutex", timeout=options["unacked_mutex_expire"]).acquire(blocking=False)
    with Connection(redis_url, transport="shared.transport:Transport", transport_options=options) as conn:
        qos = conn.channel().qos
        deadline = time.monotonic() + 30  # the old minute's lock would still be held then
        while _where(client) != (1, 0) and time.monotonic() < deadline:
            qos.restore_visible(num=10, interval=1)
            time.sleep(0.1)
        assert _where(client) == (1, 0), "the dead restorer's mutex held up the restore"


def test_the_backlogs_ahead_list_is_taken_before_the_rest_of_its_lane(redis_url: str) -> None:
    """A key's first backlog jobs while another key's fill the lane are published on the ahead list
    (kombu's priority step names.AHEAD_STEP), and taken before the lane's other jobs, in their own
    order; a ticket on the interactive lane still comes first (docs/design.md, "Lanes and
    backpressure")."""
    backlog = Queue("mrc.backlog", Exchange("mrc.backlog", type="direct"), routing_key="mrc.backlog")
    ticket = Queue(
        "mrc.interactive", Exchange("mrc.interactive", type="direct"), routing_key="mrc.interactive"
    )
    with _connect(redis_url) as conn:
        producer = Producer(conn.channel())
        for n, queue, priority in [(0, backlog, None), (1, backlog, None), (2, backlog, names.AHEAD_STEP),
                                   (3, ticket, None), (4, backlog, names.AHEAD_STEP)]:  # fmt: skip
            producer.publish({"n": n}, exchange=queue.exchange, routing_key=queue.routing_key,
                             declare=[queue], serializer="json", priority=priority)  # fmt: skip
    client = redis_lib.Redis.from_url(redis_url)
    assert client.llen(names.queue_keys("backlog")[names.AHEAD_STEP // 3]) == 2  # the step's own list
    received: list[int] = []
    with _connect(redis_url) as conn:
        callback = lambda body, message: (received.append(body["n"]), message.ack())  # noqa: E731 - a one-line callback
        with Consumer(conn.channel(), [ticket, backlog], accept=["json"], callbacks=[callback]):
            deadline = time.monotonic() + 10
            while len(received) < 5 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
    assert received == [3, 2, 4, 0, 1]


def test_a_job_of_the_ahead_list_given_back_stays_ahead(redis_url: str) -> None:
    """Review, helper-107: a dying worker gave its messages back to the lane's first list whatever
    their priority, so an ahead-list job waited behind the lane after all (kombu's own restore puts a
    message back on its step's list)."""
    from shared.unacked import give_back

    backlog = Queue("mrc.backlog", Exchange("mrc.backlog", type="direct"), routing_key="mrc.backlog")
    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    with _connect(redis_url) as conn:
        producer = Producer(conn.channel())
        for n, priority in [(0, None), (1, names.AHEAD_STEP)]:
            producer.publish({"n": n}, exchange=backlog.exchange, routing_key="mrc.backlog",
                             declare=[backlog], serializer="json", priority=priority)  # fmt: skip
    taken: list[Any] = []
    with _connect(redis_url) as conn:
        callback = lambda body, message: taken.append(message)  # noqa: E731 - a one-line callback
        with Consumer(conn.channel(), [backlog], accept=["json"], callbacks=[callback]):
            deadline = time.monotonic() + 10
            while len(taken) < 2 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
            assert give_back(client, [message.delivery_tag for message in taken]) == 2
    main, ahead = names.queue_keys("backlog")[0], names.priority_list("mrc.backlog", names.AHEAD_STEP)
    assert [json.loads(raw)["properties"]["priority"] for raw in client.lrange(ahead, 0, -1)] == [3]
    assert client.llen(main) == 1
