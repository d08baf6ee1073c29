"""Where images come from and where results go: two seams, each a protocol with an S3 implementation
(`s3.py`: AWS, MinIO, Ceph, any S3-compatible endpoint) and an in-process one for unit tests
(`memory.py`). `open_stores` builds the pair from settings; a second kind of store is a module here
with classes that have these methods, and a branch in `open_stores`.
"""

from __future__ import annotations

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


def open_stores(settings: Settings, attempts: int = 3) -> tuple[ImageSource, ResultStore]:
    """The image source and result store for these settings (today: S3 for both, one connection)."""
    from shared.stores.s3 import S3Connection, S3ImageSource, S3ResultStore

    connection = S3Connection(settings, attempts)
    return S3ImageSource(connection, settings), S3ResultStore(connection, settings)
