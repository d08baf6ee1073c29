"""`/v1/batches`: create, retrieve, list (paged), cancel. A batch is a backlog run of its input
file's requests (the batch id is the run id: `mrc backlog status BATCH_ID` works on it), on the
backlog lane with its depth limit; producer/openai/batch_run.py moves it along.

Creating one checks the request and the file (an upload of the owner's with purpose `batch`, holding
1..MRC_OPENAI_BATCH_MAX_LINES requests), copies the file beside the run (`runs/<batch_id>/input.jsonl`:
deleting the file later takes nothing from the batch; the copy goes once the batch is final), and
records it `validating`. Its lines are
checked as they are enqueued; each refused one ends in the error file. A second batch from the same
file is a new run: new job ids, new files, nothing shared but the content-addressed images and the
result cache (answers reused for the same image and prompt, `cache_hit: true`).
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from producer.http.guard import Caller
from producer.openai.batch_book import IDEMPOTENCY_TTL_S, BatchBook, batch_object, new_batch_id
from producer.openai.batch_run import Runner, input_key
from producer.openai.chat_request import check_metadata, invalid
from producer.openai.errors import OpenAIError
from producer.openai.files import Files, listing
from shared import logs

ENDPOINTS = ("/v1/chat/completions",)


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


def not_found(batch_id: str) -> OpenAIError:
    return OpenAIError(404, f"No batch found with id '{batch_id[:100]}'", "batch_id", "not_found")


_NOT_REUSED = frozenset({"failed", "expired", "cancelled", "cancelling"})  # a retry's match that ran nothing


class Batches:
    def __init__(self, runner: Runner, book: BatchBook, files: Files) -> None:
        self.runner, self.book, self.files = runner, book, files
        self.settings = runner.settings
        self.log = logs.get_logger()

    def create(
        self, caller: Caller, body: object, idempotency_key: str | None, digest: str | None = None
    ) -> dict[str, Any]:
        """`digest`: the body's sha256. Without an Idempotency-Key (the SDKs send none) the same bytes
        from the same key within MRC_OPENAI_RETRY_WINDOW_S are the same batch, as a chat request's are
        the same job: an SDK's retry after a lost answer ran a second whole batch (review, helper-98).
        A batch that failed, expired or was cancelled is not reused: sending it again makes a new one."""
        if "backlog" not in caller.lanes:
            raise OpenAIError(
                403, "this key may not use the backlog lane, where batches run", None, "forbidden"
            )
        request = self._checked(body)
        scope, key, ttl = "batch", idempotency_key, IDEMPOTENCY_TTL_S
        if key is None and digest is not None and self.settings.openai_retry_window_s > 0:
            scope, key, ttl = "batch-retry", digest, max(1, int(self.settings.openai_retry_window_s))
        batch_id = new_batch_id()
        if key is not None:  # before the input's look: it may be deleted since (review)
            batch_id, fresh = self._claimed(caller, scope, key, batch_id, ttl)
            if not fresh:
                return self._again(caller, batch_id, request.input_file_id, key, scope)
        try:
            meta = self._input(caller.owner, request.input_file_id)
            self._start(caller, batch_id, request, meta)
        except BaseException:
            if key is not None:  # nothing was made: a retry makes it afresh
                self.book.unmap(scope, caller.owner, key)
            raise
        self.log.info(
            "MRC_BATCH_CREATED",
            batch_id=batch_id,
            input_file_id=request.input_file_id,
            requests=meta["lines"],
            owner=caller.owner,
        )
        self.runner.advance(batch_id)  # its enqueue starts now, not at the keeper's next look
        return self.retrieve(caller, batch_id)

    def _start(self, caller: Caller, batch_id: str, request: CreateBatch, meta: dict[str, Any]) -> None:
        created = time.time()
        self.files.copy(str(meta["key"]), input_key(self.settings.s3_prefix, batch_id))
        self.runner.backlog.runs.start(batch_id, f"openai:{request.input_file_id}")
        self.book.create(
            batch_id,
            caller.owner,
            {
                "id": batch_id,
                "endpoint": request.endpoint,
                "completion_window": request.completion_window,
                "input_file_id": request.input_file_id,
                "metadata": json.dumps(request.metadata or {}),
                "created_at": f"{created:.3f}",
                "expires_at": f"{created + self.settings.openai_batch_window_s:.3f}",
                "status": "validating",
                "lines": str(meta["lines"]),
                "api_key": caller.key_id or "",
            },
        )

    def _checked(self, body: object) -> CreateBatch:
        if not isinstance(body, dict):  # review: "Invalid value for None: ..."
            raise OpenAIError(400, "the body must be a JSON object", None, "invalid_value")
        try:
            request = CreateBatch.model_validate(body)
        except ValidationError as exc:  # as the chat route answers (a missing field by its code: review)
            raise invalid(exc) from None
        if request.endpoint not in ENDPOINTS:
            raise OpenAIError(
                400,
                f"endpoint: mrc runs batches of {', '.join(ENDPOINTS)} only",
                "endpoint",
                "unsupported_value",
            )
        if request.completion_window != "24h":
            raise OpenAIError(
                400, "completion_window: 24h is the only window", "completion_window", "unsupported_value"
            )
        if request.output_expires_after is not None:
            raise OpenAIError(
                400,
                "output_expires_after: output files are kept until deleted",
                "output_expires_after",
                "unsupported_value",
            )
        if request.metadata:
            check_metadata(request.metadata)
        return request

    def _input(self, owner: str, file_id: str) -> dict[str, Any]:
        meta = self.files.get(owner, file_id)
        if meta.get("purpose") != "batch":
            raise OpenAIError(
                400,
                f"file {file_id} has purpose {meta.get('purpose')!r}; a batch needs one "
                "uploaded with purpose=batch",
                "input_file_id",
                "invalid_value",
            )
        lines, limit = int(meta.get("lines", 0)), self.settings.openai_batch_max_lines
        if not 1 <= lines <= limit:
            raise OpenAIError(
                400,
                f"file {file_id} holds {lines} requests; a batch takes 1 to {limit}",
                "input_file_id",
                "invalid_value",
            )
        return meta

    def _claimed(self, caller: Caller, scope: str, key: str, batch_id: str, ttl: int) -> tuple[str, bool]:
        """The batch the key names (`batch_id` if none yet), and whether it is new. A retry's match that
        ended without running (failed, expired, cancelled) names a new batch now."""
        named, fresh = self.book.idempotent(scope, caller.owner, key, batch_id, ttl)
        if fresh or scope != "batch-retry":
            return named, fresh
        if self.book.get(named).get("status") not in _NOT_REUSED:
            return named, False
        now_named = self.book.remap(scope, caller.owner, key, named, batch_id, ttl)
        return now_named, now_named == batch_id

    def _again(
        self, caller: Caller, batch_id: str, input_file_id: str, key: str, scope: str = "batch"
    ) -> dict[str, Any]:
        """A retried create (the same Idempotency-Key, or the same bytes): the batch the first one made,
        once made."""
        record = self.book.made(scope, caller.owner, key, batch_id, lambda: self.book.get(batch_id) or None)
        if not record:
            raise OpenAIError(
                409,
                "a batch with this Idempotency-Key is being created; retry shortly",
                None,
                "conflict",
                headers={"x-should-retry": "true", "retry-after": "1"},
            )
        if record.get("input_file_id") != input_file_id:
            raise OpenAIError(
                409, "this Idempotency-Key was used for a batch of another file", None, "conflict"
            )
        return self.retrieve(caller, batch_id)

    def retrieve(self, caller: Caller, batch_id: str) -> dict[str, Any]:
        record = self._mine(caller, batch_id)
        counts, usage = self.runner.counts(record)
        return batch_object(record, counts, usage)

    def _mine(self, caller: Caller, batch_id: str) -> dict[str, str]:
        record = self.book.get(batch_id) if batch_id.startswith("batch_") and len(batch_id) < 100 else {}
        if not record or record.get("owner") != caller.owner:
            raise not_found(batch_id)
        return record

    def list(self, caller: Caller, after: str | None, limit: int) -> dict[str, Any]:
        ids, more = self.book.page(caller.owner, after, limit)
        data = []
        for batch_id in ids:
            record = self.book.get(batch_id)
            if not record:
                self.book.forget(caller.owner, batch_id)
                continue
            counts, usage = self.runner.counts(record)
            data.append(batch_object(record, counts, usage))
        return listing(data, more)

    def cancel(self, caller: Caller, batch_id: str) -> dict[str, Any]:
        """`cancelling` (then `cancelled`, every line in exactly one file), or 409 when it is too late to
        stop anything: every request has ended and the files are being written (`finalizing`), or
        the batch is final. A batch already being cancelled answers as it is."""
        record = self._mine(caller, batch_id)
        if record.get("ended_by") != "cancelled" and not self.runner.end(batch_id, "cancelled"):
            latest = self.book.get(batch_id)  # another cancel may have won since: answered as it is
            status = latest.get("status") or record.get("status")
            if latest.get("ended_by") != "cancelled" and status != "cancelled":
                raise OpenAIError(
                    409,
                    f"batch {batch_id} is {status}; every request has ended, there is nothing to cancel",
                    None,
                    "conflict",
                )
        return self.retrieve(caller, batch_id)
