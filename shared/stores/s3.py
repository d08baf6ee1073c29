"""The stores over boto3: S3 itself or any S3-compatible endpoint (MinIO, Ceph, moto's test server)."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any, cast

import boto3
import botocore.handlers
import botocore.utils
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from urllib3.exceptions import HTTPError

from shared import encoding, logs, names
from shared.errors import BucketMissing, ImageTooLarge, StoreRefused, StoreUnavailable
from shared.settings import Settings

_MISSING = {"NoSuchKey", "404", "NotFound", "NoSuchBucket"}
# A create that lost to another's: ours already (a bucket owned by someone else then fails the write).
_MADE = {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}
# What only a person can change: who we are, what we may do, what the bucket is called (review: a 400
# RequestTimeout read as a refusal for good).
_REFUSALS = {
    "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
    "ExpiredToken", "AccountProblem", "InvalidBucketName", "IllegalLocationConstraintException",
    "TooManyBuckets",
}  # fmt: skip
_RESULT_MAX_BYTES = 16 * 1024 * 1024
INPUT_REFRESH_S = 86_400  # an upload's content sent again after a day is written again (put_input)
# An input this small is written without asking first whether it is there: the PUT is one round trip,
# the HEAD one more (two for a new photo, most of a chat's), and sending its bytes again costs less
# than a round trip (review, helper-120). A larger one is looked for first, and not sent twice.
INPUT_PUT_AT_ONCE_BYTES = 256 * 1024
# A body at least this large is sent with `Expect: 100-continue` (the server may refuse it before its
# bytes go); a smaller one is not: botocore adds the header to every upload, which makes each PUT two
# round trips (a result's 2 KiB, an input's, a Batch's lines: review, helper-120, 57 ms against a
# GET's 31 ms at 25 ms of latency). The AWS SDK for Go draws its line at 2 MiB too.
_EXPECT_CONTINUE_BYTES = 2 * 1024 * 1024
INPUT_REMEMBERED_S, INPUT_REMEMBERED_KEYS = 600, 4096  # S3ImageSource._written
_TEXT_MAX_BYTES = 256 * 1024 * 1024
_PART_BYTES = 8 * 1024 * 1024  # multipart parts: S3 wants >= 5 MiB for every part but the last


def _is_missing(exc: ClientError) -> bool:
    return str(exc.response.get("Error", {}).get("Code", "")) in _MISSING


def _addressing(settings: Settings) -> str:
    if settings.s3_addressing_style != "auto":
        return settings.s3_addressing_style
    return "path" if settings.s3_endpoint_url else "auto"


# S3 on a request's path (mrc-api): a call waits this long for S3's answer, and is tried twice. A
# hung S3 held each request 90 s (3 tries of 30 s) before its 503 (review, helper-98); S3 answers an
# upload's last part or a lookup in well under a second when it is well.
REQUEST_READ_TIMEOUT_S = 10.0
REQUEST_ATTEMPTS = 2
MAX_S3_CONNECTIONS = 160


def _expect_continue_for_large_bodies(model: Any, params: dict[str, Any], **kwargs: Any) -> None:
    """botocore's `add_expect_header`, for a body of _EXPECT_CONTINUE_BYTES or more only."""
    body = params.get("body")
    try:
        size = botocore.utils.determine_content_length(body) if body is not None else None
    except (OSError, ValueError):  # a stream that cannot say (a pipe): botocore's own way
        size = None
    if size is not None and size < _EXPECT_CONTINUE_BYTES:
        return
    botocore.handlers.add_expect_header(model, params, **kwargs)


class S3Connection:
    """One boto3 client and the error mapping every store shares: an outage, a server error or a broken
    stream is StoreUnavailable (retryable); "no such key" stays a ClientError for the caller."""

    def __init__(self, settings: Settings, attempts: int = 3, read_timeout: float = 30) -> None:
        config = Config(
            retries={"total_max_attempts": attempts, "mode": "standard"},
            connect_timeout=settings.connect_timeout_s,
            read_timeout=read_timeout,
            # A worker's S3 calls at once: per lane 16 image fetches and 16 result writes, 16 looks
            # a lane, a decode's re-fetch; mrc-api's Batches 32 uploads each, several at once. boto3's
            # pool of 10 discarded connections under far less ("Connection pool is full", review;
            # 64 was full at a worker's defaults once its fetches and writes went at once: helper-121).
            max_pool_connections=MAX_S3_CONNECTIONS,
            s3={"addressing_style": _addressing(settings)},  # type: ignore[arg-type]  # a Literal there
            request_checksum_calculation=settings.s3_checksums,
            response_checksum_validation=settings.s3_checksums,
        )
        self.client = boto3.client(
            "s3",
            endpoint_url=settings.s3_endpoint_url or None,
            region_name=settings.s3_region,
            config=config,
        )
        # Each time a bucket was found missing (S3ImageSource forgets the inputs it wrote then): the
        # count changes, the exact number does not matter (an increment lost to a race still changes it).
        self.bucket_losses = 0
        events = self.client.meta.events
        events.unregister("before-call.s3", botocore.handlers.add_expect_header)
        events.register("before-call.s3", _expect_continue_for_large_bodies)

    def close(self) -> None:
        """Let go of the pooled connections (a process that makes stores again and again: mrc-api's
        apps in tests)."""
        self.client.close()

    def call(self, method: str, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, method)(**kwargs)
        except ClientError as exc:
            if _is_missing(exc):
                if method == "head_bucket" or exc.response.get("Error", {}).get("Code") == "NoSuchBucket":
                    self.bucket_losses += 1  # a bucket not there: what was remembered of it is void
                raise
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if status >= 500 or status == 0:
                raise StoreUnavailable(f"S3 {method} failed: {exc}") from exc
            raise
        except BotoCoreError as exc:
            raise StoreUnavailable(f"S3 {method} failed: {exc}") from exc

    def list_page(
        self,
        bucket: str,
        prefix: str,
        token: str | None,
        max_keys: int = 1000,
        start_after: str | None = None,
    ) -> Any:
        """One page of a listing. A bucket that is not there is BucketMissing, a refusal (no
        s3:ListBucket, a name S3 will not take) StoreRefused, each naming the bucket: one line and exit
        5 from a command, not a traceback (review, helper-82)."""
        try:
            return self.call(
                "list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=max_keys,
                **({"ContinuationToken": token} if token else {}),
                **({"StartAfter": start_after} if start_after and not token else {}),
            )  # fmt: skip
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            where = f"s3://{bucket}/{prefix}"
            if code == "NoSuchBucket":
                raise BucketMissing(f"S3 bucket {bucket!r} does not exist (listing {where})") from exc
            if status == 403 or code in _REFUSALS:
                raise StoreRefused(f"S3 refused listing {where}: {code or status}") from exc
            raise

    def get(self, bucket: str, key: str, max_bytes: int) -> bytes | None:
        try:
            obj = self.call("get_object", Bucket=bucket, Key=key)
        except ClientError as exc:
            if _is_missing(exc):
                return None
            raise
        size = obj.get("ContentLength")
        if size is not None and int(size) > max_bytes:
            obj["Body"].close()
            raise ImageTooLarge(f"image is {size} bytes; the limit is {max_bytes}")
        data = _read_body(obj["Body"], max_bytes + 1, f"s3://{bucket}/{key}")
        if len(data) > max_bytes:
            raise ImageTooLarge(f"image exceeds the byte limit of {max_bytes}")
        if size is not None and len(data) != int(size):
            # A connection closed mid-body: read() returns what arrived. The object is fine; retry.
            raise StoreUnavailable(f"short read of s3://{bucket}/{key}: {len(data)} of {size} bytes")
        return data

    def exists(self, bucket: str, key: str) -> bool:
        return self.modified(bucket, key) is not None

    def modified(self, bucket: str, key: str) -> datetime | None:
        """When the object was last written (what a lifecycle rule's days count from), or None."""
        try:
            head = self.call("head_object", Bucket=bucket, Key=key)
        except ClientError as exc:
            if _is_missing(exc):
                return None
            raise
        return cast(datetime, head["LastModified"])

    def put(self, bucket: str, key: str, data: bytes, content_type: str) -> None:
        try:
            self.call("put_object", Bucket=bucket, Key=key, Body=data, ContentType=content_type)
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) != "NoSuchBucket":
                raise
            # The bucket went away under us (deleted, or a store that lost its data): made again, as at
            # start, instead of every writer failing (review: every worker exited 70 on it). Said loudly:
            # what it held is gone.
            logs.get_logger().warning("MRC_BUCKET_RECREATED", bucket=bucket, key=key)
            self.ensure_bucket(bucket)
            self.call("put_object", Bucket=bucket, Key=key, Body=data, ContentType=content_type)

    def ensure_bucket(self, bucket: str) -> None:
        """The bucket made if missing. A refusal (AccessDenied: a misspelt bucket, or credentials that
        may not create it) is StoreRefused naming it (an outage stays StoreUnavailable): a command
        exits 5 with one line, a worker before its model loads (review: a traceback and exit 1, the
        worker after minutes of loading)."""
        try:
            self._ensure_bucket(bucket)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            said = f"{error.get('Code', '?')}: {str(error.get('Message', ''))[:120]}"
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if status != 403 and str(error.get("Code", "")) not in _REFUSALS:  # RequestTimeout, SlowDown...
                raise StoreUnavailable(f"S3 could not make bucket {bucket!r} now ({said})") from exc
            raise StoreRefused(
                f"S3 refused bucket {bucket!r} ({said}): create it, check MRC_S3_BUCKET, or let these "
                "credentials create it"
            ) from exc

    def _ensure_bucket(self, bucket: str) -> None:
        try:
            self.call("head_bucket", Bucket=bucket)
        except ClientError as exc:
            if not _is_missing(exc):
                raise
            # Outside us-east-1, S3 wants the region named (other S3-compatible stores ignore it).
            region = self.client.meta.region_name
            where = (
                {}
                if region in (None, "", "us-east-1")
                else {"CreateBucketConfiguration": {"LocationConstraint": region}}
            )
            try:
                self.call("create_bucket", Bucket=bucket, **where)
            except ClientError as race:  # another writer made it first (review: 8 at once, most lost)
                code = str(race.response.get("Error", {}).get("Code", ""))
                if code == "OperationAborted":  # AWS, right after a delete: retried as an outage is
                    raise StoreUnavailable(f"S3 create_bucket {bucket}: {race}") from race
                if code not in _MADE:
                    raise

    def probe(self, bucket: str) -> None:
        """One cheap request that needs the endpoint, the credentials and (if it exists) the bucket."""
        try:
            self.call("head_bucket", Bucket=bucket)
        except ClientError as exc:
            if not _is_missing(exc):  # a missing bucket is created when first needed
                raise StoreUnavailable(f"S3 refused head_bucket: {exc}") from exc


def _read_body(body: Any, limit: int, where: str) -> bytes:
    """Up to `limit` bytes of a streaming body, to its end; a broken stream is the store's fault."""
    chunks: list[bytes] = []
    got = 0
    try:
        while got < limit and (chunk := body.read(min(1 << 20, limit - got))):
            chunks.append(chunk)
            got += len(chunk)
    except (BotoCoreError, HTTPError, OSError, ValueError) as exc:
        raise StoreUnavailable(f"reading {where} failed: {exc!r}"[:500]) from exc
    finally:
        body.close()
    return b"".join(chunks)


class S3ImageSource:
    def __init__(self, connection: S3Connection, settings: Settings) -> None:
        self.connection = connection
        self.bucket = settings.s3_bucket
        self.prefix = settings.s3_prefix
        self._bucket_ready = False
        # The inputs this process wrote, or found written, lately: sent again (a chat's next turn, a
        # Batch's lines about one photo), one is not written again, nor asked about (review,
        # helper-121: a small photo's every send was a PUT, a new version in a versioned bucket).
        # Minutes, not the day of the refresh: an object deleted meanwhile (by hand, with its
        # bucket) fails its jobs `image_not_found` for that long at most.
        self._written: OrderedDict[str, float] = OrderedDict()
        self._written_lock = threading.Lock()
        # ...and forgets them when its connection finds a bucket gone (review, helper-122: a photo sent
        # again after the bucket was lost and made again was answered from memory, and its jobs failed
        # `image_not_found`). A bucket another process makes again is not seen here: INPUT_REMEMBERED_S.
        self._losses_seen = connection.bucket_losses

    def get_bytes(self, bucket: str, key: str, max_bytes: int) -> bytes | None:
        return self.connection.get(bucket, key, max_bytes)

    def put_input(self, data: bytes, key: str, content_type: str) -> str:
        if not self._bucket_ready:
            self.connection.ensure_bucket(self.bucket)
            self._bucket_ready = True
        if self._written_lately(key):
            return names.s3_uri(self.bucket, key)
        losses = self.connection.bucket_losses  # a loss found while this one writes voids it too
        # Content-addressed: a small one written whenever it is sent (INPUT_PUT_AT_ONCE_BYTES); a larger
        # one uploaded once, and again once a day while it is sent, so that a lifecycle
        # rule's days (docs/operations.md, "What S3 keeps") count from its last use, not its first: a
        # photo sent again today was deleted 30 days after its first upload, under the job that had
        # just named it (review, helper-117).
        if len(data) <= INPUT_PUT_AT_ONCE_BYTES:
            self.connection.put(self.bucket, key, data, content_type)
        else:
            modified = self.connection.modified(self.bucket, key)
            if modified is None or modified.timestamp() < time.time() - INPUT_REFRESH_S:
                self.connection.put(self.bucket, key, data, content_type)
        # there now, and fresh (a refresh due is at most INPUT_REMEMBERED_S late)
        self._remember(key, time.time(), losses)
        return names.s3_uri(self.bucket, key)

    def _written_lately(self, key: str) -> bool:
        with self._written_lock:
            self._forget_after_a_loss()
            at = self._written.get(key)
            if at is None or at < time.time() - min(INPUT_REMEMBERED_S, INPUT_REFRESH_S):
                return False
            self._written.move_to_end(key)
            return True

    def _remember(self, key: str, written: float, losses: int) -> None:
        with self._written_lock:
            self._forget_after_a_loss()
            if losses != self._losses_seen:
                # the bucket was found gone while this was written: it may have gone with it (review,
                # helper-122: remembered after the memory was cleared, its jobs failed `image_not_found`)
                return
            self._written[key] = written
            self._written.move_to_end(key)
            while len(self._written) > INPUT_REMEMBERED_KEYS:
                self._written.popitem(last=False)

    def _forget_after_a_loss(self) -> None:
        losses = self.connection.bucket_losses
        if losses != self._losses_seen:
            self._written.clear()
            self._losses_seen = losses


class S3ResultStore:
    def __init__(self, connection: S3Connection, settings: Settings) -> None:
        self.connection = connection
        self.bucket = settings.s3_bucket
        self.prefix = settings.s3_prefix

    def ensure_bucket(self) -> None:
        self.connection.ensure_bucket(self.bucket)

    def put_result(self, job_id: str, result: dict[str, Any]) -> str:
        key = names.result_key(self.prefix, job_id)
        body = encoding.to_bytes(result, separators=(",", ":"))  # never fails on what a job carried
        self.connection.put(self.bucket, key, body, "application/json")
        return names.s3_uri(self.bucket, key)

    def get_result(self, job_id: str) -> dict[str, Any] | None:
        data = self.connection.get(self.bucket, names.result_key(self.prefix, job_id), _RESULT_MAX_BYTES)
        return None if data is None else dict(json.loads(data))

    def has_result(self, job_id: str) -> bool:
        return self.connection.exists(self.bucket, names.result_key(self.prefix, job_id))

    def result_uri(self, job_id: str) -> str:
        return names.s3_uri(self.bucket, names.result_key(self.prefix, job_id))


class S3RunFiles:
    """A backlog run's files: small objects, listings by page, and streamed multipart writes."""

    page_size = 1000  # keys per listing request (S3's own maximum)

    def __init__(self, connection: S3Connection, settings: Settings) -> None:
        self.connection = connection
        self.bucket = settings.s3_bucket
        self.prefix = settings.s3_prefix

    def put_text(self, key: str, text: str) -> str:
        self.connection.put(self.bucket, key, encoding.encode(text), "application/x-ndjson")
        return names.s3_uri(self.bucket, key)

    def get_text(self, key: str) -> str | None:
        data = self.connection.get(self.bucket, key, _TEXT_MAX_BYTES)
        return None if data is None else data.decode()

    def list_keys(self, prefix: str, bucket: str | None = None) -> Iterator[str]:
        token: str | None = None
        while True:
            page = self.connection.list_page(bucket or self.bucket, prefix, token, self.page_size)
            for item in page.get("Contents", []):
                yield str(item["Key"])
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def delete(self, key: str) -> None:
        self.connection.call("delete_object", Bucket=self.bucket, Key=key)  # S3: 204 for a missing key too

    def write_lines(self, key: str, lines: Iterable[str]) -> str:
        """One object from a stream of lines: parts of 8 MiB are uploaded as they fill, so a run of
        millions of lines never sits in memory; an object smaller than one part is a plain PUT."""
        buffer = bytearray()
        upload_id: str | None = None
        parts: list[dict[str, Any]] = []
        try:
            for line in lines:
                buffer += encoding.encode(line)
                if len(buffer) >= _PART_BYTES:
                    if upload_id is None:
                        created = self.connection.call(
                            "create_multipart_upload",
                            Bucket=self.bucket,
                            Key=key,
                            ContentType="application/x-ndjson",
                        )
                        upload_id = str(created["UploadId"])
                    parts.append(self._part(key, upload_id, len(parts) + 1, bytes(buffer)))
                    buffer.clear()
            if upload_id is None:
                self.connection.put(self.bucket, key, bytes(buffer), "application/x-ndjson")
            else:
                if buffer:
                    parts.append(self._part(key, upload_id, len(parts) + 1, bytes(buffer)))
                self.connection.call(
                    "complete_multipart_upload", Bucket=self.bucket, Key=key, UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )  # fmt: skip
        except BaseException:
            if upload_id is not None:  # no half-written object, and no parts left to pay for
                self.connection.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise
        return names.s3_uri(self.bucket, key)

    def _part(self, key: str, upload_id: str, number: int, data: bytes) -> dict[str, Any]:
        reply = self.connection.call(
            "upload_part", Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
        )
        return {"PartNumber": number, "ETag": reply["ETag"]}
