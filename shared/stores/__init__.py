"""Where images come from and where results go: two seams, each a protocol with an S3 implementation
(`s3.py`: AWS, MinIO, Ceph, any S3-compatible endpoint) and an in-process one for unit tests
(`memory.py`). `open_stores` builds the pair from settings; a second kind of store is a module here
with classes that have these methods, and a branch in `open_stores`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from shared.settings import Settings


class ImageSource(Protocol):
    """Image bytes by bucket and key (any allowed bucket), and the producer's uploads."""

    bucket: str
    prefix: str

    def get_bytes(self, bucket: str, key: str, max_bytes: int) -> bytes | None:
        """The object's bytes (None when there is none); ImageTooLarge past `max_bytes`,
        StoreUnavailable for an outage or a body cut short."""

    def put_input(self, data: bytes, key: str, content_type: str) -> str:
        """Store an uploaded image under `key` in our bucket, once per content; returns its URI."""


class ResultStore(Protocol):
    """One result object per job, `<prefix>results/<job_id>.json` in our bucket."""

    bucket: str
    prefix: str

    def ensure_bucket(self) -> None:
        """Create the bucket if it is missing."""

    def put_result(self, job_id: str, result: dict[str, Any]) -> str:
        """Write the job's result object; returns its URI."""

    def get_result(self, job_id: str) -> dict[str, Any] | None:
        """The job's result object, or None."""

    def has_result(self, job_id: str) -> bool:
        """Whether the job has a result object (a HEAD: cheaper than reading it)."""

    def result_uri(self, job_id: str) -> str:
        """Where the job's result is, whether or not it exists yet."""


class RunFiles(Protocol):
    """Text objects of backlog runs in our bucket (keys relative to the bucket, prefix included)."""

    bucket: str
    prefix: str

    def put_text(self, key: str, text: str) -> str:
        """Write one small object; returns its URI."""

    def get_text(self, key: str) -> str | None:
        """One object's text, or None."""

    def list_keys(self, prefix: str, bucket: str | None = None) -> Iterator[str]:
        """Every key under `prefix` (in our bucket, or `bucket`), in key order, page by page (never the
        whole listing at once)."""

    def write_lines(self, key: str, lines: Iterable[str]) -> str:
        """Stream lines (each ending in a newline) into one object without holding them all."""

    def delete(self, key: str) -> None:
        """Remove one object (none there: nothing to do)."""


def open_run_files(settings: Settings, attempts: int = 3) -> RunFiles:
    from shared.stores.s3 import S3Connection, S3RunFiles

    return S3RunFiles(S3Connection(settings, attempts), settings)


def open_stores(
    settings: Settings, attempts: int = 3, read_timeout: float = 30.0
) -> tuple[ImageSource, ResultStore]:
    """The image source and result store for these settings (today: S3 for both, one connection).
    `read_timeout`: how long one call waits for S3's answer before it is tried again (`attempts`)."""
    from shared.stores.s3 import S3Connection, S3ImageSource, S3ResultStore

    connection = S3Connection(settings, attempts, read_timeout)
    return S3ImageSource(connection, settings), S3ResultStore(connection, settings)
