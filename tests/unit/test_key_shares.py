"""The backlog lane's key shares (shared/backlog_share.py): a job is held from its queuing to its end,
and the room each owner gets, in the in-process records and in the Redis scripts (a redis-server of
its own); through the public routes: tests/integration/test_tenants.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from producer.queue import resubmission
from producer.queue.sender import Queue
from scripts import devservices as services
from shared import backlog_share, logs, names
from shared.errors import PushUnconfirmed, QueueFull
from shared.jobs import Job
from shared.memory_records import MemoryJobRecords
from shared.records import JobRecords, RedisJobRecords
from shared.stores.memory import MemoryStore

ALICE, BOB, CAROL = "a1a1a1a1a1a1", "b2b2b2b2b2b2", "c3c3c3c3c3c3"


def _queued(records: MemoryJobRecords, job_id: str, lane: str = "backlog") -> None:
    token = records.claim(job_id, lane)
    assert token is not None
    assert records.confirm(job_id, token)


def test_an_owner_alone_has_the_limit_and_several_share_it() -> None:
    records = MemoryJobRecords()
    for n in range(4):
        _queued(records, f"{ALICE}~a{n}")
    _queued(records, f"{ALICE}~ticket", lane="interactive")  # tickets hold nothing
    alone = records.backlog_room(ALICE, 6)
    assert (alone.room, alone.held, alone.keys) == (6, 4, 1)  # the depth decides (none here)
    _queued(records, f"{BOB}~b0")
    assert records.backlog_room(ALICE, 6).room == 3 - 4  # past her share of 3
    bob = records.backlog_room(BOB, 6)
    assert (bob.room, bob.held, bob.keys) == (2, 1, 2)
    assert bob.refusal(6, owner=BOB) == (
        "the lane is shared by the 2 keys with work in it (queued or running): this key holds 1 jobs, "
        "its share is 3"
    )
    assert "the command line (its runs, no key, count as one) holds 1 jobs" in bob.refusal(6, owner="-")
    _queued(records, "nightly-7")  # the command line (no key) is a third owner
    assert records.backlog_room(backlog_share.NO_KEY, 6).room == 1  # ceil(6 / 3) - 1
    for job_id in ("nightly-7", f"{BOB}~b0"):
        records.set_state(job_id, "succeeded" if job_id == "nightly-7" else "failed")
    assert records.backlog_room(ALICE, 6).keys == 1  # the others' ends let go of their holds
    records.set_state(f"{ALICE}~a0", "running")  # running is still held
    assert records.backlog_room(ALICE, 6).held == 4


def test_a_job_that_ended_before_its_confirm_is_not_held() -> None:
    """A worker may take and finish a single submission between its push and its confirm: held then,
    it would count until the 24-hour look let it go."""
    records = MemoryJobRecords()
    token = records.claim(f"{BOB}~fast", "backlog")
    assert token is not None
    records.set_state(f"{BOB}~fast", "succeeded")
    assert records.confirm(f"{BOB}~fast", token)
    assert records.backlog_room(BOB, 6).held == 0


def test_the_owner_of_a_job_is_its_keys_namespace_or_none() -> None:
    assert backlog_share.owner_of(f"{ALICE}~order-1") == ALICE
    assert backlog_share.owner_of("order-1") == backlog_share.NO_KEY
    assert backlog_share.Room(0, 6, 6, 1).refusal(6) == ""  # alone: the depth limit says it all


@pytest.fixture
def redis_records(redis_server: services.Service) -> Iterator[RedisJobRecords]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield RedisJobRecords(client)
    client.close()


def test_the_redis_steps_hold_each_backlog_job_once_from_its_queuing_to_its_end(
    redis_records: RedisJobRecords,
) -> None:
    """The scripts themselves: a confirm holds, an end lets go (twice: once), a job that ended before its
    confirm is not held, and a dead letter requeued (review, helper-103: it went back to the lane
    unheld, so its key counted as having no work) or a lost message pushed again is held again."""
    records = redis_records
    for n in range(3):
        token = records.claim(f"{ALICE}~a{n}", "backlog")
        assert token is not None
        assert records.confirm(f"{ALICE}~a{n}", token)
    ticket = records.claim(f"{ALICE}~t", "interactive")
    assert ticket is not None
    assert records.confirm(f"{ALICE}~t", ticket)
    assert records.backlog_room(ALICE, 10).held == 3
    records.set_state(f"{ALICE}~a0", "running")
    records.set_state(f"{ALICE}~a0", "failed")
    records.set_state(f"{ALICE}~a0", "failed")  # an end written twice lets go once
    assert records.backlog_room(ALICE, 10).held == 2
    records.reset_attempts(f"{ALICE}~a0", "requeue-push")  # `mrc dlq requeue`
    assert records.backlog_room(ALICE, 10).held == 3
    records.hold_backlog(f"{ALICE}~a0")  # pushed again after a lost message: still held once
    assert records.backlog_room(ALICE, 10).held == 3
    records.set_state(f"{ALICE}~a1", "succeeded")
    records.hold_backlog(f"{ALICE}~a1")  # ended: not held again
    fast = records.claim(f"{BOB}~fast", "backlog")
    assert fast is not None
    records.set_state(f"{BOB}~fast", "succeeded")  # a worker finished it before its confirm
    assert records.confirm(f"{BOB}~fast", fast)
    room = records.backlog_room(BOB, 10)
    assert (room.held, room.keys, room.room) == (0, 2, 5)  # alice holds a0, a2: bob has half of 10
    assert records.backlog_room(ALICE, 10, shares=False).room == 10  # off: the depth alone (empty lane)


def test_a_claim_takes_its_room_in_the_same_step(any_records: JobRecords) -> None:
    """Review, helper-103: a single submission looked at the room, then claimed, so submissions at once
    passed the depth and a key's share by their number. A claim on the backlog lane now takes its room
    in its own step: until its confirm holds the job (or its release or lease gives the room back) it
    counts in the depth and in its owner's jobs."""
    records = any_records
    tokens = [records.claim(f"{ALICE}~c{n}", "backlog", limit=3) for n in range(3)]
    assert all(tokens)
    with pytest.raises(backlog_share.NoRoom) as full:
        records.claim(f"{ALICE}~c3", "backlog", limit=3)
    assert (full.value.room.room, full.value.room.depth, full.value.room.held) == (0, 3, 3)
    assert not records.get(f"{ALICE}~c3")  # nothing written for the refused claim
    assert records.claim(f"{ALICE}~t", "interactive", limit=3)  # tickets take no backlog room
    records.release(f"{ALICE}~c0", str(tokens[0]))  # a send that failed gives its room back
    assert records.claim(f"{ALICE}~c3", "backlog", limit=3)
    assert records.confirm(f"{ALICE}~c1", str(tokens[1]))  # confirmed: held instead of claimed
    room = records.backlog_room(ALICE, 3)
    assert (room.room, room.depth, room.held) == (1, 2, 3)  # c1 held (its message not in a list here)
    assert records.claim(f"{BOB}~b0", "backlog", limit=3)  # his share is 2 (alice holds 3)
    assert records.claim(f"{BOB}~b1", "backlog", limit=3)
    with pytest.raises(backlog_share.NoRoom) as shared:  # his claims count for his share too
        records.claim(f"{BOB}~b2", "backlog", limit=3)
    assert (shared.value.room.keys, shared.value.room.held) == (2, 2)


def test_a_claim_whose_producer_died_gives_its_room_back_after_its_lease(
    redis_server: services.Service,
) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        records = RedisJobRecords(client, claim_ttl_s=1)
        token = records.claim(f"{ALICE}~gone", "backlog", limit=1)
        assert token is not None
        with pytest.raises(backlog_share.NoRoom):
            records.claim(f"{ALICE}~next", "backlog", limit=1)
        assert records.renew(f"{ALICE}~gone", token)  # a renewed claim keeps its room for a fresh lease
        time.sleep(1.5)
        assert records.claim(f"{ALICE}~next", "backlog", limit=1)
        assert client.zcard(names.backlog_claims_key()) == 1  # the lapsed claim's room is gone with it
    finally:
        client.close()


@pytest.mark.parametrize("shares", [False, True])
def test_submissions_at_once_get_no_more_room_than_the_lane_has(
    redis_server: services.Service, shares: bool
) -> None:
    """Thirty single submissions at once through the producer's queue (a real Redis, its broker): alone,
    exactly the depth is let in; beside another key holding the lane, exactly the share."""
    env = {"MRC_REDIS_URL": redis_server.url, "MRC_BACKLOG_MAX_DEPTH": "10"}
    settings = services.settings_from_env(env)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    queue = Queue(settings, images=MemoryStore(), results=MemoryStore())
    try:
        records = RedisJobRecords(client)
        if shares:
            for n in range(10):  # alice holds the whole lane: bob's share is 5
                token = records.claim(f"{ALICE}~held{n}", "backlog")
                assert token is not None
                assert records.confirm(f"{ALICE}~held{n}", token)
        outcomes: list[str] = []

        def submit(n: int) -> None:
            job = Job(job_id=f"{BOB}~j{n}", image_uri="s3://b/p.jpg", prompt="Torn?", lane="backlog",
                      max_new_tokens=8, api_key=BOB)  # fmt: skip
            try:
                outcomes.append("queued" if queue.enqueue(job, block=False) else "same")
            except QueueFull:
                outcomes.append("full")

        threads = [threading.Thread(target=submit, args=(n,)) for n in range(30)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wanted = 5 if shares else 10
        assert outcomes.count("queued") == wanted, outcomes
        assert outcomes.count("full") == 30 - wanted
        assert queue.lane_depth("backlog") == wanted
        assert client.zcard(names.backlog_claims_key()) == 0  # every claim confirmed or refused
    finally:
        queue.close()
        client.close()


class _Landed(MemoryJobRecords):
    def pushed(self, push_id: str) -> bool:
        return True  # the push's marker is where the record is


def test_a_job_pushed_again_is_held_only_once_its_push_landed() -> None:
    """A lost message pushed again was held before its send: a send that failed left a job in no lane
    counting for its key's share for a day."""
    job = Job(job_id=f"{ALICE}~lost", image_uri="s3://b/p.jpg", prompt="Torn?", lane="backlog",
              max_new_tokens=8, api_key=ALICE)  # fmt: skip

    def refused(job: Job, push_id: str) -> None:
        raise ConnectionError("the broker went away")

    for records, send in ((MemoryJobRecords(), refused), (_Landed(), lambda job, push_id: None)):
        token = records.claim(job.job_id, "backlog")
        assert token is not None
        records.confirm(job.job_id, token)
        records.set_state(job.job_id, "queued")  # a queued job's hold let go: as after a lost Redis
        records.held.clear()
        if send is refused:
            with pytest.raises(PushUnconfirmed):
                resubmission.push_again(job, "push-1", records, send, logs.get_logger())
            assert records.backlog_room(ALICE, 10).held == 0
        else:
            resubmission.push_again(job, "push-1", records, send, logs.get_logger())
            assert records.backlog_room(ALICE, 10).held == 1


@pytest.fixture
def lane(redis_server: services.Service) -> Iterator[tuple[Queue, redis.Redis, MemoryStore]]:
    """A producer's queue at a backlog depth of 1 on a redis-server of its own, the lane full (one
    message that is no job's: its depth alone counts)."""
    settings = services.settings_from_env({"MRC_REDIS_URL": redis_server.url, "MRC_BACKLOG_MAX_DEPTH": "1"})
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    results = MemoryStore()
    queue = Queue(settings, images=MemoryStore(), results=results)
    client.lpush(names.queue_keys("backlog")[0], "filler")
    yield queue, client, results
    queue.close()
    client.close()


def _job(job_id: str) -> Job:
    return Job(job_id=job_id, image_uri="s3://b/p.jpg", prompt="Torn?", lane="backlog", max_new_tokens=8)


def test_two_blocking_submissions_of_one_id_that_waited_for_room_are_one_job(
    lane: tuple[Queue, redis.Redis, MemoryStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review, helper-105: the wait on another submission's claim was timed from before the wait for
    room, so the second of two blocking submissions of one id that had waited long exited 5 ("cannot
    reach Redis: ... neither ends nor expires") as the first one's claim was being published."""
    from producer.queue import sender

    monkeypatch.setattr(sender, "CLAIM_TTL_S", 0.5)  # a wait on another's claim: 5.5 s at most
    queue, client, _ = lane
    outcomes: list[object] = []

    def submit() -> None:
        try:
            outcomes.append(queue.enqueue(_job("dup-1"), block=True, timeout=60))
        except Exception as exc:  # the outcome is what is asserted
            outcomes.append(exc)

    threads = [threading.Thread(target=submit) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(7)  # both wait for room longer than a wait on a claim may last
    client.rpop(names.queue_keys("backlog")[0])
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes, key=str) == [False, True], outcomes


def test_a_job_whose_result_is_stored_is_answered_with_the_lane_full(
    lane: tuple[Queue, redis.Redis, MemoryStore],
) -> None:
    """Review, helper-105: a job whose record had expired and whose result is stored met 503 with the
    lane full, and 200 with a place free: it needs no room (it is not queued again)."""
    queue, _, results = lane
    job = _job("done-1")
    results.put_result(
        job.job_id, {"job_id": job.job_id, "status": "succeeded", "job_fingerprint": job.fingerprint()}
    )
    assert queue.enqueue(job, block=False) is False  # the same job, answered from its result
    with pytest.raises(QueueFull, match="the limit is 1"):
        queue.enqueue(_job("new-1"), block=False)


def test_claims_are_timed_on_redis_clock_and_shown_where_the_lane_is(
    redis_records: RedisJobRecords, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review, helper-105: a producer whose clock ran 40 s ahead let go of every other producer's
    claims (they were timed on each producer's clock) and took their room; and the views of the lane
    left claims out, so it showed room while it refused."""
    import shared.records

    records = redis_records
    assert records.claim(f"{ALICE}~a", "backlog", limit=2)
    assert records.claim(f"{ALICE}~b", "backlog", limit=2)
    real = time.time
    monkeypatch.setattr(shared.records.time, "time", lambda: real() + 40)  # another producer's clock
    with pytest.raises(backlog_share.NoRoom) as full:
        records.claim(f"{ALICE}~c", "backlog", limit=2)
    monkeypatch.undo()
    assert (full.value.room.depth, full.value.room.claims) == (2, 2)
    assert full.value.room.refusal(2, owner=ALICE) == "2 of them being queued now"
    assert backlog_share.held(records._redis) == {ALICE: 2}


def test_a_refusal_at_twice_the_limit_says_so() -> None:
    """Review, helper-105: an owner under its share, stopped by the lane at twice its limit, was told
    its share alone."""
    capped = backlog_share.Room(0, 20, 2, 4)
    assert "the lane holds twice its limit while the shares settle (at most 20)" in capped.refusal(
        10, owner="-"
    )
    assert "twice" not in backlog_share.Room(0, 12, 3, 4).refusal(10, owner="-")  # past its share of 3


def _submitter(queue: Queue) -> Callable[[str, int], None]:
    """Submits the owner's n-th single backlog job through the producer's queue (it must go in)."""

    def submit(owner: str, n: int) -> None:
        job = Job(job_id=f"{owner}~j{n}", image_uri="s3://b/p.jpg", prompt="Torn?", lane="backlog",
                  max_new_tokens=8, api_key=owner)  # fmt: skip
        assert queue.enqueue(job, block=False)

    return submit


@pytest.mark.parametrize("ahead_jobs", [2, 0])
def test_a_keys_first_jobs_beside_anothers_go_on_the_ahead_list(
    redis_server: services.Service, ahead_jobs: int
) -> None:
    """Left out since helper-97: another key's first backlog job waited behind the whole lane (up to
    MRC_BACKLOG_MAX_DEPTH of one key's batch). While another key's jobs are in the lane, a key holding
    fewer than MRC_BACKLOG_AHEAD_JOBS has its next ones published on the ahead list (taken first:
    tests/integration/test_transport.py); a key alone, or past that count, joins the lane's end."""
    env = {"MRC_REDIS_URL": redis_server.url, "MRC_BACKLOG_AHEAD_JOBS": str(ahead_jobs)}
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    queue = Queue(services.settings_from_env(env), images=MemoryStore(), results=MemoryStore())
    main, ahead = names.queue_keys("backlog")[0], names.queue_keys("backlog")[names.AHEAD_STEP // 3]
    submit = _submitter(queue)
    try:
        for n in range(5):
            submit(ALICE, n)  # alone: the lane's end, whatever she holds
        assert (client.llen(main), client.llen(ahead)) == (5, 0)
        for n in range(3):
            submit(BOB, n)  # beside hers: his first `ahead_jobs` go ahead
        submit(ALICE, 5)  # past the count: the end
        assert client.llen(ahead) == ahead_jobs
        assert client.llen(main) == 9 - ahead_jobs
        # The ahead list holds `ahead_jobs` in all (review, helper-107: four keys holding 8 each left
        # a big batch 6 % of the jobs ended): a third key with none held joins the end while it is full.
        submit(CAROL, 0)
        assert (client.llen(ahead), client.llen(main)) == (ahead_jobs, 10 - ahead_jobs)
        client.rpop(ahead)  # taken by a worker: room on the ahead list again
        submit(CAROL, 1)
        assert client.llen(ahead) == (ahead_jobs if ahead_jobs else 0)
    finally:
        queue.close()
        client.close()


def test_a_backlog_claim_sent_again_by_redis_py_is_still_its_holders(
    redis_records: RedisJobRecords, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review, helper-107: a claim step whose reply was lost, sent again with its token, answers {1}
    without the room (its own claim): read as a room, it raised ValueError and the submission failed
    while its claim kept the id and the room for 30 s."""
    import shared.records

    monkeypatch.setattr(shared.records.secrets, "token_hex", lambda n: "same-token")
    first = redis_records.claim_backlog(f"{ALICE}~again", "fp", limit=5)
    again = redis_records.claim_backlog(f"{ALICE}~again", "fp", limit=5)
    assert first is not None
    assert again is not None
    assert (first[0], again[0]) == ("same-token", "same-token")
    assert not again[1].bound_ahead  # nothing known of the room: not ahead


def test_claims_at_once_bind_no_more_jobs_for_the_ahead_list_than_its_cap(any_records: JobRecords) -> None:
    """Review, helper-108: four keys sending 8 single backlog jobs each at once put 9 and 12 on the
    ahead list against 8 (each claim read the list's length alone, and none was on it yet). The claim
    step binds a job for the ahead list and counts it there until its confirm or release."""
    for n in range(10):  # another key's batch in the lane: newcomers' first jobs may go ahead
        token = any_records.claim(f"{ALICE}~held{n}", "backlog")
        assert token is not None
        assert any_records.confirm(f"{ALICE}~held{n}", token)
    bound: dict[str, int] = {}
    claims: list[tuple[str, str]] = []
    for n in range(8):  # every claim before any confirm: as submissions at once
        for owner in (BOB, CAROL, "d4d4d4d4d4d4", "e5e5e5e5e5e5"):
            taken = any_records.claim_backlog(f"{owner}~j{n}", "fp", limit=1000, ahead_most=8)
            assert taken is not None
            claims.append((f"{owner}~j{n}", taken[0]))
            bound[owner] = bound.get(owner, 0) + taken[1].bound_ahead
    assert sum(bound.values()) == 8, bound
    assert any_records.backlog_room(BOB, 1000).ahead == 8  # the list holds none yet: the claims count
    # A released claim gives its place back; a confirmed one leaves it to the list (where its job is).
    job_id, token = next((job_id, token) for job_id, token in claims if job_id.startswith(BOB))
    any_records.release(job_id, token)
    assert any_records.backlog_room(BOB, 1000).ahead == 7
    for job_id, token in claims:
        any_records.confirm(job_id, token)
    assert any_records.backlog_room(BOB, 1000).ahead == 0
    # Off (0), or a key alone in the lane: none is bound ahead.
    off = any_records.claim_backlog(f"{BOB}~off", "fp", limit=1000, ahead_most=0)
    assert off is not None
    assert not off[1].bound_ahead


def test_submissions_at_once_from_several_keys_fill_the_ahead_list_to_its_cap(
    redis_server: services.Service,
) -> None:
    """The same through the producer's queue, 32 threads from four keys beside a fifth's batch."""
    env = {"MRC_REDIS_URL": redis_server.url, "MRC_BACKLOG_AHEAD_JOBS": "8"}
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    queue = Queue(services.settings_from_env(env), images=MemoryStore(), results=MemoryStore())
    ahead = names.queue_keys("backlog")[names.AHEAD_STEP // 3]
    owners = (BOB, CAROL, "d4d4d4d4d4d4", "e5e5e5e5e5e5")
    submit = _submitter(queue)
    try:
        for n in range(10):
            submit(ALICE, n)
        threads = [threading.Thread(target=submit, args=(owner, n)) for n in range(8) for owner in owners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert client.llen(ahead) == 8
        assert queue.lane_depth("backlog") == 42
        assert client.zcard(names.backlog_claims_key()) == 0
    finally:
        queue.close()
        client.close()
