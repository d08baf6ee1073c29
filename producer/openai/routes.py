"""The OpenAI-compatible routes of mrc-api, mounted beside /v1/jobs (same keys, rate limits, body
limits and lanes: producer/http/front.py runs first):

POST /v1/chat/completions · GET /v1/models[/{model}] · POST /v1/files · GET /v1/files ·
GET/DELETE /v1/files/{id} · GET /v1/files/{id}/content · POST /v1/batches · GET /v1/batches ·
GET /v1/batches/{id} · POST /v1/batches/{id}/cancel

Shapes as OpenAI defines them, so the official SDKs work with `base_url` pointed here; errors in
OpenAI's shape (producer/openai/errors.py). Files and batches belong to the key that made them.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import FormData, UploadFile

from producer.http.front import caller_of
from producer.http.state import ApiState
from producer.openai.batch_book import IDEMPOTENCY_TTL_S, BatchBook, key_digest
from producer.openai.batch_run import Keeper, Runner
from producer.openai.batches import Batches, CreateBatch
from producer.openai.chat import Chat
from producer.openai.chat_request import idempotency_key, read_json
from producer.openai.errors import OpenAIError
from producer.openai.files import PURPOSES, Files, new_file_id, public, upload_digest
from producer.openai.models import Models
from producer.openai.protocol import ChatRequest
from shared import logs
from shared.records import answer_timeout_s, connect

_FILE_FORM = {"file", "purpose"}


def _query(name: str, kind: str = "string", **schema: Any) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": {"type": kind, **schema}}


def _body(schema: dict[str, Any], kind: str = "application/json") -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {kind: {"schema": schema}}}}


def _int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    # Past 4,300 digits int() raises (review, helper-88: `limit=` and 5,000 nines was a 500); no bound
    # here is longer than 20 digits, and leading zeros do not make a number larger.
    digits = raw.lstrip("0") or "0"
    if not raw.isascii() or not raw.isdigit() or len(digits) > 20 or not low <= int(digits) <= high:
        raise OpenAIError(400, f"{name} must be an integer from {low} to {high}", name, "invalid_value")
    return int(digits)


def _stored(
    book: BatchBook, files: Files, owner: str, key: str, file_id: str, scope: str = "file"
) -> dict[str, Any]:
    """A retried upload (the same Idempotency-Key, or the same bytes within the retry window): the file
    the first one stored, once stored."""

    def look() -> dict[str, Any] | None:
        try:
            return files.get(owner, file_id)
        except OpenAIError:
            return None

    meta = book.made(scope, owner, key, file_id, look)
    if meta is None:
        named = "this Idempotency-Key" if scope == "file" else "these bytes (the same upload, sent again)"
        raise OpenAIError(
            409,
            f"a file with {named} is being stored; retry shortly",
            None,
            "conflict",
            headers={"x-should-retry": "true", "retry-after": "1"},
        )
    return public(meta)


def _file_form(form: FormData) -> tuple[UploadFile, str]:
    """An upload's file part and purpose, or the 400 naming what is wrong with its form."""
    unknown = sorted(set(form.keys()) - _FILE_FORM)
    if unknown:
        raise OpenAIError(
            400,
            f"Unrecognized request argument supplied: {unknown[0][:64]} (files are kept until deleted)",
            unknown[0][:64],
            "unknown_parameter",
        )
    upload, purpose = form.get("file"), form.get("purpose")
    if upload is None or isinstance(upload, str):
        raise OpenAIError(
            400,
            "Missing required parameter: file (a file part)",
            "file",
            "missing_required_parameter",
        )
    if purpose not in PURPOSES:
        raise OpenAIError(
            400,
            "purpose: mrc keeps files for the Batch API only (purpose=batch)",
            "purpose",
            "unsupported_value",
        )
    return upload, str(purpose)


class OpenAIRoutes:
    """State and handlers of the OpenAI-compatible routes; the batch stack is built on first use."""

    def __init__(self, state: ApiState) -> None:
        self.state, self.settings = state, state.settings
        self._redis: Any = None
        self._lock = threading.Lock()
        self.models = Models(self.settings, self.redis)
        self.chat = Chat(state, self.models, self.redis)
        self._batches: Batches | None = None
        self._files: Files | None = None
        self._book: BatchBook | None = None
        self._runner_redis: Any = None
        self._runner_book: BatchBook | None = None
        self._runner_s3: Any = None
        self._keeper: Keeper | None = None

    def redis(self) -> Any:
        """The request path's client: a command Redis does not answer within MRC_CONNECT_TIMEOUT_S
        (and the replicas' WAIT) fails at once, as a submission's does, and the request answers 503
        (review, helper-98: with the riding-out client a hung Redis held each chat request 30 s to 3
        minutes, and their threads starved every other route)."""
        if self._redis is None:
            answer_s = answer_timeout_s(self.settings)
            self._redis = connect(self.settings, self.settings.connect_timeout_s, retries=2,
                                  socket_timeout=answer_s, retry_timeouts=False)  # fmt: skip
        return self._redis

    def runner_redis(self) -> Any:
        """The batch runner's client, off any request: it rides out a Redis restart or failover."""
        if self._runner_redis is None:
            self._runner_redis = connect(self.settings, self.settings.connect_timeout_s, retries=2)
        return self._runner_redis

    def book(self) -> BatchBook:
        if self._book is None:
            self._book = BatchBook(self.redis())
        return self._book

    def runner_book(self) -> BatchBook:
        if self._runner_book is None:
            self._runner_book = BatchBook(self.runner_redis())
        return self._runner_book

    def _stack(self) -> tuple[Files, Batches]:
        """The files and batches machinery, built on first use (S3 clients, the producer client)."""
        with self._lock:
            if self._batches is None or self._files is None:
                from producer.backlog.run import Backlog
                from producer.intake.intake import Intake
                from shared.stores import s3

                # Files answer requests: a hung S3 is a 503 in seconds. The runner's run files are off
                # any request, and ride out a slow S3.
                asked = s3.S3Connection(self.settings, s3.REQUEST_ATTEMPTS, s3.REQUEST_READ_TIMEOUT_S)
                self._files = Files(self.settings, asked)
                self._runner_s3 = s3.S3Connection(self.settings)
                run_files = s3.S3RunFiles(self._runner_s3, self.settings)
                # The lines' images are stored through the runner's connection too (helper-100)
                intake = Intake(self.settings, s3.S3ImageSource(self._runner_s3, self.settings))
                backlog = Backlog(self.state.queue, files=run_files, intake=intake)
                runner_files = Files(self.settings, self._runner_s3)  # its input and output, off any request
                runner = Runner(backlog, self.runner_book(), runner_files, self.models, self.runner_redis())
                self._batches = Batches(runner, self.book(), self._files)
            return self._files, self._batches

    def start(self) -> None:
        """This process's batch keeper (it resumes, expires and finishes batches in flight)."""
        self._keeper = Keeper(
            self.settings.openai_batch_poll_s,
            lambda: self.runner_book().active(),
            lambda: self._stack()[1].runner,
        )
        self._keeper.start()

    def stop(self) -> None:
        if self._keeper is not None:
            self._keeper.stop()
        if self._batches is not None:
            self._batches.runner.stop()
            self._batches.runner.backlog.runs.close()
        if self._files is not None:
            self._files.connection.close()
        if self._runner_s3 is not None:
            self._runner_s3.close()
        for client in (self._redis, self._runner_redis):
            if client is not None:
                client.close()

    # ------------------------------------------------------------------ files
    async def create_file(self, request: Request) -> Response:
        files, batches = await run_in_threadpool(self._stack)
        kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind != "multipart/form-data":
            raise OpenAIError(
                415,
                "send multipart/form-data with a file part and purpose=batch",
                None,
                "unsupported_media_type",
            )
        caller = caller_of(request.scope)
        if not caller.lanes:  # an `ops` (or `all-tenants`) key alone: it submits nothing (review)
            raise OpenAIError(403, "this key may submit to no lane, so it keeps no files", None, "forbidden")
        async with request.form(max_files=1, max_fields=8) as form:
            upload, purpose = _file_form(form)
            key, scope, ttl = idempotency_key(request.headers), "file", IDEMPOTENCY_TTL_S
            if key is None and self.settings.openai_retry_window_s > 0:
                # The SDK sends no Idempotency-Key, and retries an upload whose answer was lost: the
                # same bytes (name and purpose) from the same key within the window are the same file.
                filename = upload.filename or ""
                key = await run_in_threadpool(upload_digest, upload.file, filename, purpose)
                scope, ttl = "file-retry", max(1, int(self.settings.openai_retry_window_s))
            file_id, fresh = new_file_id(), True
            if key is not None:
                file_id, fresh = await run_in_threadpool(
                    batches.book.idempotent, scope, caller.owner, key, file_id, ttl
                )
            if key is not None and not fresh:  # a retried upload: the file the first one stored
                stored = await run_in_threadpool(
                    _stored, batches.book, files, caller.owner, key, file_id, scope
                )
                return JSONResponse(stored)
            try:
                meta = await run_in_threadpool(
                    files.create,
                    caller.owner,
                    upload.file,
                    upload.filename or "",
                    purpose,
                    file_id,
                    (scope, key_digest(key)) if key is not None else ("", ""),
                )
            except BaseException:
                if key is not None:  # nothing stored: a retry stores it afresh
                    await run_in_threadpool(batches.book.unmap, scope, caller.owner, key)
                raise
        logs.get_logger().info(
            "MRC_FILE_CREATED",
            file_id=meta["id"],
            bytes=meta["bytes"],
            requests=meta["lines"],
            owner=caller.owner,
        )
        return JSONResponse(public(meta))

    async def list_files(self, request: Request) -> Response:
        files, _ = await run_in_threadpool(self._stack)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise OpenAIError(400, "order must be asc or desc", "order", "invalid_value")
        limit = _int(request, "limit", 10_000, 1, 10_000)
        owner = caller_of(request.scope).owner
        page = await run_in_threadpool(
            files.list,
            owner,
            request.query_params.get("purpose"),
            limit,
            order,
            request.query_params.get("after"),
        )
        return JSONResponse(page)

    async def get_file(self, file_id: str, request: Request) -> Response:
        files, _ = await run_in_threadpool(self._stack)
        return JSONResponse(
            public(await run_in_threadpool(files.get, caller_of(request.scope).owner, file_id))
        )

    async def file_content(self, file_id: str, request: Request) -> Response:
        files, _ = await run_in_threadpool(self._stack)
        chunks = await run_in_threadpool(files.content, caller_of(request.scope).owner, file_id)
        return StreamingResponse(chunks, media_type="application/jsonl")

    async def delete_file(self, file_id: str, request: Request) -> Response:
        files, batches = await run_in_threadpool(self._stack)
        owner = caller_of(request.scope).owner

        def forget_key(meta: dict[str, Any]) -> None:
            if meta.get("idempotency"):  # its key (or its bytes) names a new upload from now on
                scope = str(meta.get("idempotency_scope") or "file")
                batches.book.unmap_deleted(scope, owner, str(meta["idempotency"]), file_id)

        deleted = await run_in_threadpool(files.delete, owner, file_id, forget_key)
        logs.get_logger().info("MRC_FILE_DELETED", file_id=file_id, owner=caller_of(request.scope).owner)
        return JSONResponse(deleted)

    # ------------------------------------------------------------------ batches
    async def create_batch(self, request: Request) -> Response:
        _, batches = await run_in_threadpool(self._stack)
        key = idempotency_key(request.headers)
        raw = await request.body()
        body = await run_in_threadpool(read_json, raw)  # parsed off the event loop
        caller = caller_of(request.scope)
        digest = hashlib.sha256(raw).hexdigest()
        return JSONResponse(await run_in_threadpool(batches.create, caller, body, key, digest))

    async def list_batches(self, request: Request) -> Response:
        _, batches = await run_in_threadpool(self._stack)
        limit = _int(request, "limit", 20, 1, 100)
        after = request.query_params.get("after")
        return JSONResponse(await run_in_threadpool(batches.list, caller_of(request.scope), after, limit))

    async def get_batch(self, batch_id: str, request: Request) -> Response:
        _, batches = await run_in_threadpool(self._stack)
        return JSONResponse(await run_in_threadpool(batches.retrieve, caller_of(request.scope), batch_id))

    async def cancel_batch(self, batch_id: str, request: Request) -> Response:
        _, batches = await run_in_threadpool(self._stack)
        return JSONResponse(await run_in_threadpool(batches.cancel, caller_of(request.scope), batch_id))

    # ------------------------------------------------------------------ mount
    def mount(self, app: FastAPI) -> None:
        async def openai_error(_request: Request, exc: Exception) -> Response:
            assert isinstance(exc, OpenAIError)
            return exc.response()

        app.add_exception_handler(OpenAIError, openai_error)
        chat_body = _body(ChatRequest.model_json_schema())
        file_form = {
            "type": "object",
            "required": ["file", "purpose"],
            "properties": {
                "file": {"type": "string", "format": "binary"},
                "purpose": {"type": "string", "enum": ["batch"]},
            },
        }
        listing = [_query("after"), _query("limit", "integer", minimum=1)]
        routes: list[tuple[str, Any, str, dict[str, Any]]] = [
            ("/v1/chat/completions", self.chat.create, "POST", chat_body),
            ("/v1/models", self.models.models_list, "GET", {}),
            ("/v1/models/{model:path}", self.models.model, "GET", {}),
            ("/v1/files", self.create_file, "POST", _body(file_form, "multipart/form-data")),
            (
                "/v1/files",
                self.list_files,
                "GET",
                {"parameters": [*listing, _query("purpose"), _query("order", enum=["asc", "desc"])]},
            ),
            ("/v1/files/{file_id}", self.get_file, "GET", {}),
            ("/v1/files/{file_id}", self.delete_file, "DELETE", {}),
            ("/v1/files/{file_id}/content", self.file_content, "GET", {}),
            ("/v1/batches", self.create_batch, "POST", _body(CreateBatch.model_json_schema())),
            ("/v1/batches", self.list_batches, "GET", {"parameters": listing}),
            ("/v1/batches/{batch_id}", self.get_batch, "GET", {}),
            ("/v1/batches/{batch_id}/cancel", self.cancel_batch, "POST", {}),
        ]
        for path, handler, method, extra in routes:
            app.add_api_route(path, handler, methods=[method], openapi_extra=extra or None, tags=["openai"])
