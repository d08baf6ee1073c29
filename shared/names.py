"""Queue names, Redis keys and S3 keys, built in one place so producer and worker cannot disagree."""

from __future__ import annotations

import re
import uuid
from typing import Final

TASK_NAME: Final = "mrc.infer"
LANES: Final = ("interactive", "backlog")
REDIS_PREFIX: Final = "mrc:"


# kombu's Redis transport keeps one list per priority step; a message without priority goes to the first.
_PRIORITY_SEP = "\x06\x16"
_PRIORITY_STEPS = (0, 3, 6, 9)


def queue_name(lane: str) -> str:
    return f"mrc.{lane}"


# The backlog's "ahead" list: a key's first few backlog jobs while another key's fill the lane
# (shared/backlog_share.py, MRC_BACKLOG_AHEAD_JOBS) are published at this kombu priority step, and
# mrc's pop takes that list of the backlog before the backlog's first (kombu's own order, step 0 first,
# would take it last). Every other reader of a lane already reads all its steps (queue_keys).
AHEAD_STEP: Final = 3


def priority_list(queue: str, step: int) -> str:
    """The Redis list of one of a queue's priority steps, as kombu names it."""
    return queue if step == 0 else f"{queue}{_PRIORITY_SEP}{step}"


def pop_steps(queue: str, steps: list[int] | tuple[int, ...]) -> list[int]:
    """The order a consumer takes a queue's priority lists in: kombu's, but the backlog's ahead list
    first."""
    if queue != queue_name("backlog") or AHEAD_STEP not in steps:
        return list(steps)
    return [AHEAD_STEP, *(step for step in steps if step != AHEAD_STEP)]


def queue_keys(lane: str) -> list[str]:
    """Every Redis list holding the lane's messages (its depth is the sum of their lengths)."""
    name = queue_name(lane)
    return [priority_list(name, step) for step in _PRIORITY_STEPS]


# kombu's Redis transport: the hash of taken, unacked messages and its time index (kombu's own names,
# set explicitly in the transport options so every part of mrc reads the same keys).
UNACKED_KEY: Final = "unacked"
UNACKED_INDEX_KEY: Final = "unacked_index"


def unacked_owners_key(unacked_key: str = UNACKED_KEY) -> str:
    """Which process popped each unacked message (tag -> owner, shared/unacked.py): mrc's own, beside
    kombu's hash, whose records kombu's restore reads as exactly [payload, exchange, routing_key]."""
    return f"{unacked_key}_owners"


def cache_counter_keys() -> tuple[str, str]:
    return f"{REDIS_PREFIX}cache:hits", f"{REDIS_PREFIX}cache:misses"


def cache_entry_key(key: str) -> str:
    """A cached answer, under the sha256 key workers/cache.py builds."""
    return f"{REDIS_PREFIX}cache:{key}"


def rejected_key() -> str:
    """Queue entries the transport could not read, set aside for a person (the last 1000)."""
    return f"{REDIS_PREFIX}rejected"


def rejected_count_key() -> str:
    """How many queue entries were ever set aside (the list keeps only the last 1000)."""
    return f"{REDIS_PREFIX}rejected:count"


def job_key(job_id: str) -> str:
    """Redis hash with a job's state: queued / running / succeeded / failed."""
    return f"{REDIS_PREFIX}job:{job_id}"


def backlog_held_key() -> str:
    """Redis sorted set of the backlog jobs held, `"<owner> <job id>"` -> when (shared/backlog_share.py)."""
    return f"{REDIS_PREFIX}backlog:held"


def backlog_held_counts_key() -> str:
    """Redis hash: owner -> its backlog jobs held (shared/backlog_share.py)."""
    return f"{REDIS_PREFIX}backlog:held:counts"


def backlog_claims_key() -> str:
    """Redis sorted set of the backlog claims taking room, `"<owner> <job id>"` -> when their lease ends
    (shared/backlog_share.py)."""
    return f"{REDIS_PREFIX}backlog:claims"


def run_record_key(run_id: str) -> str:
    """Redis hash of a backlog run: its state (enqueuing, enqueued, cancelled) and counts."""
    return f"{REDIS_PREFIX}run:{run_id}"


def run_pass_key(run_id: str) -> str:
    """Redis string: the lease of the `mrc backlog` pass enqueueing a run (producer/backlog/run_lease.py)."""
    return f"{REDIS_PREFIX}run:{run_id}:pass"


def usage_totals_key() -> str:
    """Redis hash of token totals per API key: `<key>|<kind>` -> count (shared/usage.py)."""
    return f"{REDIS_PREFIX}usage:keys"


def batch_key(batch_id: str) -> str:
    """Redis hash of an OpenAI-style batch (producer/openai/batches.py): its state, times, file ids."""
    return f"{REDIS_PREFIX}batch:{batch_id}"


def batch_lease_key(batch_id: str, what: str) -> str:
    """Who works on a batch now (`enqueue`, `finalize`): one mrc-api process at a time."""
    return f"{REDIS_PREFIX}batch:{batch_id}:{what}"


def batches_key(owner: str) -> str:
    """Sorted set of an owner's batch ids by creation time (`GET /v1/batches`, paged)."""
    return f"{REDIS_PREFIX}batches:{owner}"


def active_batches_key() -> str:
    """Set of batch ids not yet in a final state: what mrc-api's batch keeper looks after."""
    return f"{REDIS_PREFIX}batches:active"


def idempotency_key(scope: str, owner: str, digest: str) -> str:
    """An Idempotency-Key's object (a file or a batch), per owner, kept a day."""
    return f"{REDIS_PREFIX}idem:{scope}:{owner}:{digest}"


def worker_key(hostname: str) -> str:
    return f"{REDIS_PREFIX}worker:{hostname}"


def worker_pattern() -> str:
    return f"{REDIS_PREFIX}worker:*"


def runs_recent_key() -> str:
    """Redis sorted set of backlog runs and batches by creation time (the ops page's list; the last
    1,000 kept)."""
    return f"{REDIS_PREFIX}runs:recent"


def workers_seen_key() -> str:
    """Redis sorted set: each worker's heartbeat key by the time of its last beat (the ops page reads
    the live ones without scanning the keyspace); members older than WORKER_SEEN_S are let go."""
    return f"{REDIS_PREFIX}workers:seen"


WORKER_SEEN_S = 60  # a worker not seen for this long is gone from the list (its entry expires after 15 s)


def ops_minute_key(minute: int) -> str:
    """Redis hash of one minute's ops counts (shared/ops_counts.py): jobs out, failures by code,
    latency buckets, the lanes' depth; `minute` = epoch seconds // 60."""
    return f"{REDIS_PREFIX}ops:minute:{minute}"


def ops_day_key(day: str) -> str:
    """Redis hash of one UTC day's tokens per API key (`YYYY-MM-DD`; shared/ops_counts.py)."""
    return f"{REDIS_PREFIX}ops:day:{day}"


def answer_key(job_id: str) -> str:
    """Redis string: an interactive job's result object, the bytes stored in S3, kept a short while
    (shared/records.py ANSWER_TTL_S) for the waits on it to read with its record instead of from S3."""
    return f"{REDIS_PREFIX}answer:{job_id}"


def stream_key(job_id: str) -> str:
    """Redis stream of a streamed job's text as it is decoded (`stream: true`; workers/streaming.py):
    bounded in length and life, read by the mrc-api request that streams it."""
    return f"{REDIS_PREFIX}stream:{job_id}"


def events_key(owner: str | None = None) -> str:
    """Redis stream of completion events, one per finished job (capped; `mrc events`); with an owner,
    that API key's own stream of its jobs' events (`GET /v1/events`, shared/tenants.py)."""
    return f"{REDIS_PREFIX}events" if owner is None else f"{REDIS_PREFIX}events:{owner}"


def job_push_id(job_id: str) -> str:
    """The push id of a job's publish by a producer: the same for every submission of the job."""
    return f"job:{job_id}"


def requeue_push_id(job_id: str) -> str:
    """The push id of one deliberate resend of a job (a dead letter requeued): its own push, never
    taken for a retry of the job's submission, the same through the transport's retries of it."""
    return f"{job_push_id(job_id)}:requeue:{uuid.uuid4().hex}"


def push_key(push_id: str) -> str:
    """Marks one publish as pushed, from the push until an hour after its message is acked
    (shared/pushes.py): a publish retried after its first attempt landed finds it and pushes nothing
    twice, and a resubmission finding none knows the message is in no lane and held by no worker."""
    return f"{REDIS_PREFIX}pushed:{push_id}"


def replication_probe_key() -> str:
    """A key written just to WAIT for (shared/records.py, `replicated`)."""
    return f"{REDIS_PREFIX}replication-probe"


PUSH_HEADER: Final = "mrc_push"  # the message header naming one publish (shared/celery_app.py)


def dead_letter_key() -> str:
    return f"{REDIS_PREFIX}dlq"


def dead_letter_processing_key() -> str:
    """Entries `mrc dlq requeue` has taken but not yet sent: nothing is lost if it dies meanwhile."""
    return f"{REDIS_PREFIX}dlq:processing"


def result_key(prefix: str, job_id: str) -> str:
    return f"{prefix}results/{job_id}.json"


def run_key(prefix: str, run_id: str, name: str) -> str:
    """A backlog run's file: `<prefix>runs/<run_id>/<name>` (results.jsonl, errors.jsonl, index/...)."""
    return f"{prefix}runs/{run_id}/{name}"


def file_key(prefix: str, owner: str, file_id: str, ext: str) -> str:
    """An uploaded file (`.jsonl`) and every file's description (`.json`), per owner:
    `<prefix>files/<owner>/<file_id>.<ext>` (a batch's output lives in its run's folder)."""
    return f"{prefix}files/{owner}/{file_id}.{ext}"


def uploads_folder(prefix: str, owner: str | None = None) -> str:
    """Where uploaded images live: `<prefix>inputs/`, and an API key's own `<prefix>inputs/<owner>/`
    (shared/tenants.py)."""
    return f"{prefix}inputs/" if owner is None else f"{prefix}inputs/{owner}/"


def input_key(prefix: str, sha256: str, ext: str, owner: str | None = None) -> str:
    """An uploaded image, content-addressed (per API key: no key reads another's uploads)."""
    return f"{uploads_folder(prefix, owner)}{sha256}.{ext}"


_SHA256_RE = re.compile(r"[0-9a-f]{64}\Z")
_OWNER_RE = re.compile(r"[0-9a-f]{12}\Z")  # an API key's id (shared/tenants.py, which imports this module)


def content_sha256(uri: str, bucket: str, prefix: str) -> str | None:
    """The sha256 an uploaded image's URI names it by (`input_key` in mrc's own bucket: the producer
    writes there only bytes under their own hash, and never changes them); None for any other URI."""
    try:
        in_bucket, key = parse_s3_uri(uri)
    except ValueError:
        return None
    folder = uploads_folder(prefix)
    if in_bucket != bucket or not key.startswith(folder):
        return None
    owner, _, name = key[len(folder) :].rpartition("/")
    if owner and not _OWNER_RE.match(owner):
        return None
    sha256, dot, ext = name.partition(".")
    return sha256 if dot and ext and _SHA256_RE.match(sha256) else None


def s3_uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


S3_KEY_MAX_BYTES = 1024  # S3's limit on an object key, in UTF-8 bytes
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")
_CONTROL = re.compile("[\x00-\x1f\x7f]")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split s3://bucket/key; raise ValueError for anything else. A key with a `.`, `..` or empty
    segment is refused: some S3-compatible endpoints resolve it as a path (or fold `//`), so it could
    reach another bucket or another key's folder."""
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri[:80]!r}")
    bucket, _, key = uri[5:].partition("/")
    if not bucket or not key:
        raise ValueError(f"s3 URI needs a bucket and a key: {uri[:80]!r}")
    if not _BUCKET_RE.match(bucket):
        raise ValueError(f"not a valid bucket name: {bucket[:80]!r}")
    if any(segment in (".", "..") for segment in key.split("/")):
        raise ValueError(f"s3 key may not contain '.' or '..' segments: {uri[:80]!r}")
    if "//" in key or key.startswith("/"):  # some stores fold `//`: a key would read as another's (review)
        raise ValueError(f"s3 key may not contain an empty segment (//): {uri[:80]!r}")
    if _CONTROL.search(key):
        raise ValueError(f"s3 key may not contain control characters: {uri[:80]!r}")
    size = len(key.encode("utf-8", "surrogatepass"))
    if size > S3_KEY_MAX_BYTES:  # no object has such a key: refused here, not failed by the worker
        raise ValueError(f"s3 key is {size} bytes; S3 allows at most {S3_KEY_MAX_BYTES}: {uri[:80]!r}...")
    return bucket, key


def key_allowed(key: str, prefix: str) -> bool:
    """Whether `key` lies under `prefix` (which ends with `/`, or is empty for the whole bucket)."""
    return key.startswith(prefix)
