"""`/v1/files`: files in S3, per owner (an API key), beside the backlog runs.

An uploaded file is `<prefix>files/<owner>/<file_id>.jsonl`; every file (uploads and a batch's output
and error files, whose content stays in the batch's run folder, `<prefix>runs/<batch_id>/`) is
described by `<prefix>files/<owner>/<file_id>.json`: the OpenAI file object plus where its content
is. Another owner's file id answers 404, as an unknown one. Uploads stream to S3 from the spooled
request body (never whole in memory); the upload counts the file's requests (non-blank lines), which
`POST /v1/batches` checks against its limit before anything is created.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import BotoCoreError, ClientError

from producer.openai import file_order
from producer.openai.errors import OpenAIError
from shared import encoding, names
from shared.errors import BucketMissing, StoreUnavailable
from shared.settings import Settings
from shared.stores.s3 import S3Connection

_META_READS = 8  # a page's descriptions read at once
_PUBLIC = (
    "id",
    "object",
    "bytes",
    "created_at",
    "filename",
    "purpose",
    "status",
    "status_details",
    "expires_at",
)
_META_MAX_BYTES = 64 * 1024
_READ_BYTES = 1 << 20
PURPOSES = ("batch",)


def new_file_id() -> str:
    """Time-ordered (milliseconds in hex), then random: a listing by id is a listing by age."""
    return f"file-{int(time.time() * 1000):012x}{secrets.token_hex(8)}"


def public(meta: dict[str, Any]) -> dict[str, Any]:
    return {key: meta.get(key) for key in _PUBLIC}


def listing(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """A page of objects as OpenAI lists them (the SDK pages on with `after=last_id`)."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


def not_found(file_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such File object: {file_id[:100]}", "file_id", "not_found")


def upload_digest(stream: IO[bytes], filename: str, purpose: str) -> str:
    """What names an upload's bytes (its name and purpose included) for a retry's match; the stream is
    left at its start."""
    # a name the client's charset decoded to lone surrogates (utf-7) is still a name: hashed as it came
    # The name's length first: no name and first bytes can pass for another name and other bytes (review)
    name = filename.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(f"{purpose}\0{len(name)}\0".encode() + name)
    stream.seek(0)
    while chunk := stream.read(_READ_BYTES):
        digest.update(chunk)
    stream.seek(0)
    return digest.hexdigest()


def count_requests(stream: IO[bytes]) -> tuple[int, int]:
    """(bytes, non-blank lines) of a stream, read in slices."""
    size = lines = 0
    filled = False  # the line being read so far holds something other than whitespace
    while chunk := stream.read(_READ_BYTES):
        size += len(chunk)
        pieces = chunk.split(b"\n")
        for piece in pieces[:-1]:  # each of these ends a line
            lines += 1 if filled or piece.strip() else 0
            filled = False
        filled = filled or bool(pieces[-1].strip())
    return size, lines + (1 if filled else 0)


class Files:
    def __init__(self, settings: Settings, connection: S3Connection) -> None:
        self.settings = settings
        self.connection = connection
        self.bucket = settings.s3_bucket
        self.prefix = settings.s3_prefix
        # a folder of up to this many keys (two a file) is listed in one call and sorted here; the
        # windows of a larger one are read this many keys a call
        self.whole_listing, self.window_page = 1000, 200

    def _meta_key(self, owner: str, file_id: str) -> str:
        return names.file_key(self.prefix, owner, file_id, "json")

    def create(
        self,
        owner: str,
        stream: IO[bytes],
        filename: str,
        purpose: str,
        file_id: str | None = None,
        idempotency: tuple[str, str] = ("", ""),
    ) -> dict[str, Any]:
        """Store an upload (its purpose checked by the caller); the file object. `idempotency`: the
        scope and digest of the key it was made under (an Idempotency-Key, or its bytes for a retry's
        match), forgotten with the file when it is deleted."""
        size, lines = count_requests(stream)
        if size > self.settings.openai_file_max_bytes:
            raise OpenAIError(
                413,
                f"the file is {size} bytes; the limit is {self.settings.openai_file_max_bytes}",
                "file",
                "file_too_large",
            )
        if lines == 0:
            raise OpenAIError(400, "the file holds no requests (no non-blank line)", "file", "empty_file")
        stream.seek(0)
        file_id = file_id or new_file_id()
        key = names.file_key(self.prefix, owner, file_id, "jsonl")
        self.connection.ensure_bucket(self.bucket)
        try:
            self.connection.client.upload_fileobj(
                stream, self.bucket, key, ExtraArgs={"ContentType": "application/jsonl"}
            )
        except (S3UploadFailedError, BotoCoreError, ClientError) as exc:
            raise StoreUnavailable(f"S3 upload of {key} failed: {exc}"[:500]) from exc
        return self._describe(owner, file_id, key, size, filename, purpose, lines, idempotency)

    def add_output(self, owner: str, file_id: str, key: str, size: int, filename: str) -> dict[str, Any]:
        """Describe a batch's output or error file (its content already written at `key`)."""
        return self._describe(owner, file_id, key, size, filename, "batch_output")

    def _describe(
        self,
        owner: str,
        file_id: str,
        key: str,
        size: int,
        filename: str,
        purpose: str,
        lines: int = 0,
        idempotency: tuple[str, str] = ("", ""),
    ) -> dict[str, Any]:
        meta = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            # the name as the client's multipart header gave it, in the charset it named: one that
            # decodes to a lone surrogate (charset=utf-7) made every later answer about it a 500
            "filename": encoding.clean(filename[:255]) or "upload.jsonl",
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
            "key": key,
            "lines": lines,
            "idempotency": idempotency[1],
            "idempotency_scope": idempotency[0],
        }
        body = json.dumps(meta).encode()
        self.connection.put(self.bucket, self._meta_key(owner, file_id), body, "application/json")
        return meta

    def get(self, owner: str, file_id: str) -> dict[str, Any]:
        """The file's description (with its content's key); 404 when the owner has no such file."""
        if not file_id.startswith("file-") or "/" in file_id or len(file_id) > 128:
            raise not_found(file_id)
        data = self.connection.get(self.bucket, self._meta_key(owner, file_id), _META_MAX_BYTES)
        if data is None:
            raise not_found(file_id)
        meta = dict(json.loads(data))
        if isinstance(meta.get("filename"), str):  # one stored before names were cleaned
            meta["filename"] = encoding.clean(meta["filename"])
        return meta

    def content(self, owner: str, file_id: str) -> Iterator[bytes]:
        """The file's bytes, streamed from S3 (the first request is made before this returns, so a
        missing object is a 404, not a broken stream)."""
        meta = self.get(owner, file_id)
        return self.stream(str(meta["key"]))

    def stream(self, key: str) -> Iterator[bytes]:
        try:
            body = self.connection.call("get_object", Bucket=self.bucket, Key=key)["Body"]
        except ClientError:
            raise OpenAIError(404, "the file's content is gone", "file_id", "not_found") from None

        def chunks() -> Iterator[bytes]:
            try:
                yield from body.iter_chunks(_READ_BYTES)
            finally:
                body.close()

        return chunks()

    def delete(self, owner: str, file_id: str, before: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Delete the file, once `before` has seen its description (its Idempotency-Key forgotten)."""
        meta = self.get(owner, file_id)
        before(meta)
        for key in (str(meta["key"]), self._meta_key(owner, file_id)):
            self.connection.call("delete_object", Bucket=self.bucket, Key=key)
        return {"id": file_id, "object": "file", "deleted": True}

    def list(
        self, owner: str, purpose: str | None, limit: int, order: str, after: str | None
    ) -> dict[str, Any]:
        """A page of the owner's files, newest first (`order=desc`) or oldest first."""
        prefix = names.file_key(self.prefix, owner, "", "")[:-1]  # `<prefix>files/<owner>/`
        ids = self._ordered(prefix, order, after)
        page: list[dict[str, Any]] = []
        # the descriptions a page shows, read side by side: one after another, 21 reads were most of
        # a page's time (bench_file_listing.py)
        with ThreadPoolExecutor(_META_READS) as pool:
            while len(page) <= limit and (wanted := list(itertools.islice(ids, limit + 1 - len(page)))):
                for meta in pool.map(lambda file_id: self._found(owner, file_id), wanted):
                    if meta is not None and (purpose is None or meta.get("purpose") == purpose):
                        page.append(public(meta))
        return listing(page[:limit], len(page) > limit)

    def _found(self, owner: str, file_id: str) -> dict[str, Any] | None:
        try:
            return self.get(owner, file_id)
        except OpenAIError:
            return None  # deleted meanwhile

    def _ordered(self, folder: str, order: str, after: str | None) -> Iterator[str]:
        """The owner's file ids in the page's order. A folder one listing holds (`whole_listing` keys)
        is sorted here, as always; a larger one is read a window at a time (file_order.py), a page
        costing about its own files. A cursor that is no id of ours (a client's own string) is placed
        among them all."""
        desc = order == "desc"
        try:
            reply = self.connection.list_page(self.bucket, folder, None, self.whole_listing)
        except BucketMissing:  # no upload yet (made at the first): no files (review, helper-82: 500)
            return iter(())
        whole = not reply.get("IsTruncated")
        if whole or (after is not None and not file_order.timed(after)):
            keys = [str(item["Key"]) for item in reply.get("Contents", [])] if whole else self._keys(folder)
            ids = sorted(file_order.ids_of(folder, keys), reverse=desc)
            return iter([i for i in ids if after is None or (i < after if desc else i > after)])

        def windows(prefix: str, start: str | None) -> Iterator[str]:
            return self._keys(prefix, start, self.window_page)

        if not desc:
            return file_order.ascending(windows, folder, after)
        listed = (str(item["Key"]) for item in reply.get("Contents", []))
        oldest = next(file_order.ids_of(folder, listed), None)  # the probe's first: no call again
        return file_order.descending(windows, folder, after, oldest)

    def _keys(self, prefix: str, start_after: str | None = None, page: int = 1000) -> Iterator[str]:
        token: str | None = None
        while True:
            try:
                reply = self.connection.list_page(self.bucket, prefix, token, page, start_after=start_after)
            except BucketMissing:  # no upload yet (made at the first): no files (review, helper-82: 500)
                return
            for item in reply.get("Contents", []):
                yield str(item["Key"])
            if not reply.get("IsTruncated"):
                return
            token = reply.get("NextContinuationToken")

    def copy(self, source_key: str, key: str) -> None:
        """A server-side copy (a batch keeps its own copy of its input: deleting the file later does
        not take the batch's lines away)."""
        self.connection.call(
            "copy_object", Bucket=self.bucket, Key=key, CopySource={"Bucket": self.bucket, "Key": source_key}
        )
