"""Keys are tenants: how an mrc-api key's jobs, uploads and events are kept apart from every other's.

- **Job ids.** A key names its jobs in a namespace of its own: the job it calls `order-42` is stored
  as `<owner>~order-42` (owner: the first 12 hex of the key's sha256), in Redis
  (`mrc:job:<owner>~order-42`) and in S3 (`results/<owner>~order-42.json`). Two keys may use the same
  id for two jobs; each reads its own, and another key's id reads as one that does not exist. `~` is
  not in the client-id alphabet, so no client id (and no `mrc submit --job-id`) can spell another
  key's stored id. Jobs submitted without a key (`mrc submit`, `mrc backlog`, an API without keys) keep
  their ids as they are, as before.
- **Uploads.** A key's uploaded images are stored under `inputs/<owner>/<sha256>.<ext>`; an `s3://`
  image a key names must be one of its own uploads or lie under a source an operator allowed for it
  (`MRC_API_KEY_SOURCES`), never another key's upload. The refusal is decided from the URI alone, so
  it says nothing of whether the object exists.
- **Events.** Every completion event goes to the fleet's stream and, for a key's job, to that key's
  own stream (`mrc:events:<owner>`), which is what the key's `GET /v1/events` reads.

Pure functions of strings (no Redis, no S3): the producer and the worker both use them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared import names

SEP = "~"
OWNER_RE = re.compile(r"^[0-9a-f]{12}\Z")
# A client's id (shared/jobs.py JOB_ID_RE) with or without its owner's namespace in front.
STORED_JOB_ID_RE = re.compile(r"^(?:[0-9a-f]{12}~)?[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z")
ALL = "*"
# Folders of mrc's own in the bucket (under MRC_S3_PREFIX) that hold jobs, files and runs, not images.
PRIVATE_FOLDERS = ("results/", "files/", "runs/")


def job_id(owner: str | None, client_id: str) -> str:
    """The stored id of the job `owner` calls `client_id` (no owner: the id as it is)."""
    return client_id if owner is None else f"{owner}{SEP}{client_id}"


def owner_of(stored_id: str) -> str | None:
    """The key that owns a stored job id, or None for a job submitted without a key."""
    head, sep, _ = stored_id.partition(SEP)
    return head if sep and OWNER_RE.match(head) else None


def client_id(namespace: str | None, stored_id: str) -> str:
    """The id as the reader in `namespace` names it: its own jobs without the prefix; a reader with
    no namespace (ops, the CLI) sees stored ids."""
    if namespace is None:
        return stored_id
    prefix = f"{namespace}{SEP}"
    return stored_id[len(prefix) :] if stored_id.startswith(prefix) else stored_id


def in_words_of(namespace: str | None, text: str) -> str:
    """A message about a reader's own jobs, their ids as the reader names them."""
    return text if namespace is None else text.replace(f"{namespace}{SEP}", "")


def own_view(stored_id: str) -> str:
    """The id as its owner names it (what a key's batch files show it)."""
    return client_id(owner_of(stored_id), stored_id)


@dataclass(frozen=True)
class Source:
    """A place an operator allowed keys to name images from: a bucket, and a key prefix in it."""

    bucket: str
    prefix: str  # "" for the whole bucket

    def holds(self, bucket: str, key: str) -> bool:
        return bucket == self.bucket and key.startswith(self.prefix)


def parse_sources(spec: str) -> dict[str, tuple[Source, ...]]:
    """`MRC_API_KEY_SOURCES`: comma-separated `WHO=s3://bucket/[prefix]`, WHO a key's hex sha256, its
    12-hex id, or `*` for every key. Returns owner (12 hex, or `*`) -> its sources; ValueError names
    a bad entry."""
    out: dict[str, list[Source]] = {}
    for raw in (part.strip() for part in spec.split(",")):
        if not raw:
            continue
        who, sep, uri = raw.partition("=")
        who = who.strip().lower()
        if not sep or not (who == ALL or OWNER_RE.match(who) or re.fullmatch(r"[0-9a-f]{64}", who)):
            raise ValueError(
                f"MRC_API_KEY_SOURCES: {raw[:40]!r} is not WHO=s3://bucket/prefix (WHO: a key's sha256, "
                "its first 12 hex, or *)"
            )
        uri = uri.strip()
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not uri.startswith("s3://") or not bucket:
            raise ValueError(f"MRC_API_KEY_SOURCES: {uri[:80]!r} is not s3://bucket/[prefix]")
        try:
            names.parse_s3_uri(f"s3://{bucket}/{prefix or 'x'}")
        except ValueError as exc:
            raise ValueError(f"MRC_API_KEY_SOURCES: {exc}") from None
        out.setdefault(who[:12] if who != ALL else ALL, []).append(Source(bucket, prefix))
    return {who: tuple(found) for who, found in out.items()}


def source_problem(
    uri: str, owner: str, bucket: str, s3_prefix: str, allowed: dict[str, tuple[Source, ...]]
) -> str | None:
    """Why the key `owner` may not name the image `uri`, or None: its own uploads (in `bucket`, under
    `<s3_prefix>inputs/<owner>/`) and the sources allowed for it or for every key, never another
    key's uploads whatever a source allows. Decided from the URI alone."""
    refusal = (
        f"image_source_forbidden: {uri[:120]} is neither an upload of this key nor under a source "
        "allowed for it (upload the image, or ask the operator to allow its place: MRC_API_KEY_SOURCES)"
    )
    try:
        found_bucket, key = names.parse_s3_uri(uri)
    except ValueError as exc:
        return f"image_source_forbidden: {exc}"
    if found_bucket == bucket:
        # mrc's own folders are never a source, whatever an operator allowed: results, files and runs
        # would tell one key about another's jobs (an object there fails differently from none).
        # Compared without case: some S3-compatible stores fold it.
        inside = key.lower()[len(s3_prefix) :] if key.lower().startswith(s3_prefix.lower()) else None
        if inside is not None and inside.startswith(PRIVATE_FOLDERS):
            return refusal
        uploads = names.uploads_folder("")  # everyone's uploads lie below it
        if inside is not None and inside.startswith(uploads):
            first = inside[len(uploads) :].partition("/")
            if first[1] and OWNER_RE.match(first[0]):  # a key's upload folder
                return None if first[0] == owner else refusal
    sources = (*allowed.get(owner, ()), *allowed.get(ALL, ()))
    return None if any(source.holds(found_bucket, key) for source in sources) else refusal
