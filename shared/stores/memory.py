"""In-process twins of the S3 stores for unit tests: the same keys and limits, a dict for a bucket."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from shared import encoding, names
from shared.errors import ImageTooLarge


class MemoryStore:
    """Both seams over one dict of (bucket, key) -> bytes, as one S3 endpoint holds both."""

    def __init__(self, bucket: str = "mrc", prefix: str = "") -> None:
        self.bucket = bucket
        self.prefix = prefix
        self.objects: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        """Put an object in our bucket (tests set up their images with it)."""
        with self._lock:
            self.objects[(self.bucket, key)] = bytes(data)

    # ImageSource
    def get_bytes(self, bucket: str, key: str, max_bytes: int) -> bytes | None:
        with self._lock:
            data = self.objects.get((bucket, key))
        if data is not None and len(data) > max_bytes:
            raise ImageTooLarge(f"image is {len(data)} bytes; the limit is {max_bytes}")
        return data

    def put_input(self, data: bytes, key: str, content_type: str) -> str:
        with self._lock:
            self.objects.setdefault((self.bucket, key), bytes(data))
        return names.s3_uri(self.bucket, key)

    # ResultStore
    def ensure_bucket(self) -> None:
        return None

    def put_result(self, job_id: str, result: dict[str, Any]) -> str:
        self.put_bytes(names.result_key(self.prefix, job_id), encoding.to_bytes(result))
        return self.result_uri(job_id)

    def get_result(self, job_id: str) -> dict[str, Any] | None:
        data = self.get_bytes(self.bucket, names.result_key(self.prefix, job_id), 1 << 30)
        return None if data is None else dict(json.loads(data))

    def has_result(self, job_id: str) -> bool:
        with self._lock:
            return (self.bucket, names.result_key(self.prefix, job_id)) in self.objects

    def result_uri(self, job_id: str) -> str:
        return names.s3_uri(self.bucket, names.result_key(self.prefix, job_id))

    # RunFiles
    def put_text(self, key: str, text: str) -> str:
        self.put_bytes(key, encoding.encode(text))
        return names.s3_uri(self.bucket, key)

    def get_text(self, key: str) -> str | None:
        data = self.get_bytes(self.bucket, key, 1 << 30)
        return None if data is None else data.decode()

    def list_keys(self, prefix: str, bucket: str | None = None) -> Iterator[str]:
        with self._lock:
            keys = sorted(k for b, k in self.objects if b == (bucket or self.bucket) and k.startswith(prefix))
        yield from keys

    def write_lines(self, key: str, lines: Iterable[str]) -> str:
        return self.put_text(key, "".join(lines))

    def delete(self, key: str) -> None:
        with self._lock:
            self.objects.pop((self.bucket, key), None)
