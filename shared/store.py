"""The result/input store: S3-compatible object storage over boto3, plus an in-process twin for unit tests."""

from __future__ import annotations

import json
import threading
from typing import Any, Protocol

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from urllib3.exceptions import HTTPError

from shared import names
from shared.errors import ImageTooLarge, StoreUnavailable
from shared.settings import Settings

_MISSING = {"NoSuchKey", "404", "NotFound", "NoSuchBucket"}


class Store(Protocol):
    bucket: str
    prefix: str

    def ensure_bucket(self) -> None: ...
    def put_bytes(self, key: str, data: bytes, content_type: str) -> None: ...
    def get_bytes(self, bucket: str, key: str, max_bytes: int) -> bytes | None: ...
    def exists(self, key: str) -> bool: ...
    def put_result(self, job_id: str, result: dict[str, Any]) -> str: ...
    def get_result(self, job_id: str) -> dict[str, Any] | None: ...


def _is_missing(exc: ClientError) -> bool:
    return str(exc.response.get("Error", {}).get("Code", "")) in _MISSING


class S3Store:
    """Objects in one bucket under one prefix; images may be read from other allowed buckets."""

    def __init__(self, settings: Settings, attempts: int = 3) -> None:
        self.bucket = settings.s3_bucket
        self.prefix = settings.s3_prefix
        config = Config(
            retries={"total_max_attempts": attempts, "mode": "standard"},
            connect_timeout=settings.connect_timeout_s,
            read_timeout=30,
            s3={"addressing_style": "path"} if settings.s3_endpoint_url else {},
        )
        self._client = boto3.client(
            "s3",
            endpoint_url=settings.s3_endpoint_url or None,
            region_name=settings.s3_region,
            config=config,
        )

    def _call(self, method: str, **kwargs: Any) -> Any:
        try:
            return getattr(self._client, method)(**kwargs)
        except ClientError as exc:
            if _is_missing(exc):
                raise
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if status >= 500 or status == 0:
                raise StoreUnavailable(f"S3 {method} failed: {exc}") from exc
            raise
        except BotoCoreError as exc:
            raise StoreUnavailable(f"S3 {method} failed: {exc}") from exc

    def probe(self) -> None:
        """One cheap request that needs the endpoint, the credentials and (if it exists) the bucket."""
        try:
            self._call("head_bucket", Bucket=self.bucket)
        except ClientError as exc:
            if not _is_missing(exc):  # a missing bucket is created when first needed
                raise StoreUnavailable(f"S3 refused head_bucket: {exc}") from exc

    def ensure_bucket(self) -> None:
        try:
            self._call("head_bucket", Bucket=self.bucket)
        except ClientError as exc:
            if not _is_missing(exc):
                raise
            self._call("create_bucket", Bucket=self.bucket)

    def put_bytes(self, key: str, data: bytes, content_type: str) -> None:
        self._call("put_object", Bucket=self.bucket, Key=key, Body=data, ContentType=content_type)

    def get_bytes(self, bucket: str, key: str, max_bytes: int) -> bytes | None:
        try:
            obj = self._call("get_object", Bucket=bucket, Key=key)
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

    def exists(self, key: str) -> bool:
        try:
            self._call("head_object", Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _is_missing(exc):
                return False
            raise
        return True

    def put_result(self, job_id: str, result: dict[str, Any]) -> str:
        key = names.result_key(self.prefix, job_id)
        body = json.dumps(result, ensure_ascii=False, separators=(",", ":")).encode()
        self.put_bytes(key, body, "application/json")
        return names.s3_uri(self.bucket, key)

    def get_result(self, job_id: str) -> dict[str, Any] | None:
        data = self.get_bytes(self.bucket, names.result_key(self.prefix, job_id), 16 * 1024 * 1024)
        return None if data is None else dict(json.loads(data))


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


class MemoryStore:
    """In-process twin of S3Store for unit tests: same keys, same limits, no network."""

    def __init__(self, bucket: str = "mrc", prefix: str = "") -> None:
        self.bucket = bucket
        self.prefix = prefix
        self.objects: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    def ensure_bucket(self) -> None:
        return None

    def put_bytes(self, key: str, data: bytes, content_type: str) -> None:
        with self._lock:
            self.objects[(self.bucket, key)] = bytes(data)

    def get_bytes(self, bucket: str, key: str, max_bytes: int) -> bytes | None:
        with self._lock:
            data = self.objects.get((bucket, key))
        if data is not None and len(data) > max_bytes:
            raise ImageTooLarge(f"image is {len(data)} bytes; the limit is {max_bytes}")
        return data

    def exists(self, key: str) -> bool:
        with self._lock:
            return (self.bucket, key) in self.objects

    def put_result(self, job_id: str, result: dict[str, Any]) -> str:
        key = names.result_key(self.prefix, job_id)
        self.put_bytes(key, json.dumps(result, ensure_ascii=False).encode(), "application/json")
        return names.s3_uri(self.bucket, key)

    def get_result(self, job_id: str) -> dict[str, Any] | None:
        data = self.get_bytes(self.bucket, names.result_key(self.prefix, job_id), 1 << 30)
        return None if data is None else dict(json.loads(data))
