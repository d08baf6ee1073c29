"""The lines of a batch input file as backlog manifest lines, so a batch runs as a backlog run
(producer/backlog/run.py: the same lane, depth limit, resume and cancel as `mrc backlog`).

Each line, `{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {a chat
request}}`, is checked as `POST /v1/chat/completions` checks its body (producer/openai/chat_request.py),
plus: a `custom_id` used once in the file, the batch's own endpoint, a model the workers serve. Its
`data:` image is checked as an upload and stored (content-addressed, 8 at a time) before the line
goes on as a manifest line with an `s3://` URI. A refused line goes on as its refusal: the backlog
records it as an invalid line, and the batch's error file says what the endpoint would have answered.

Lines are translated in small groups (bounded in bytes, not only lines: a line may hold a 40 MB
image), so the API process never holds a chunk of images. On a resume, lines of chunks already queued
are not read again (the backlog reads their index), and their custom ids count as seen.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producer.backlog import manifest
from producer.backlog.manifest import Invalid, Line
from producer.backlog.run import CHUNK_LINES
from producer.intake import checks
from producer.intake.intake import Intake
from producer.openai.chat_request import ChatJob, param_of, parse_chat
from producer.openai.errors import OpenAIError, from_usage_error
from shared import encoding
from shared.errors import UsageError
from shared.settings import Settings

_GROUP_LINES, _GROUP_BYTES = 64, 64 << 20
# A group's photos uploaded at once: each is a round trip of S3's (tens of ms), its bytes in memory
# already (the group's 64 MiB at most). Eight at a time, a fresh Batch of photos went in at ~80 lines/s
# at 25 ms of latency (review, helper-120).
_UPLOAD_THREADS = 32
INVALID = "_invalid"  # the key of a refused line's translation: {"status", "error"}


class BatchLine(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


def max_line_bytes(settings: Settings) -> int:
    """The longest line read: a request with the largest image as base64, and a MiB for the rest."""
    return (settings.max_image_bytes + 2) // 3 * 4 + (1 << 20)


class _Raw(io.RawIOBase):
    """A streaming S3 body as a raw stream (so a BufferedReader can read it line by line)."""

    def __init__(self, body: Any) -> None:
        self.body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def read_s3_lines(body: Any, max_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of a streaming S3 body, a line never more than `max_bytes` in memory."""
    try:
        yield from manifest.read_lines(io.BufferedReader(_Raw(body), 1 << 20), max_bytes)
    finally:
        body.close()


def refusal(error: OpenAIError) -> dict[str, Any]:
    return {"status": error.status, "error": error.body()["error"]}


class Translator:
    """One enqueue pass of one batch: its lines in, manifest lines out (and `parse` for the backlog)."""

    def __init__(
        self,
        intake: Intake,
        endpoint: str,
        api_key: str | None,
        models: frozenset[str],
        done_chunks: set[int],
        seen: dict[str, int],
        on_group: Callable[[], None] = lambda: None,
    ) -> None:
        self.intake, self.settings = intake, intake.settings
        self.endpoint, self.api_key, self.models = endpoint, api_key, models
        self.done_chunks, self.seen, self.on_group = done_chunks, seen, on_group
        self.max_bytes = max_line_bytes(self.settings)

    def lines(self, source: Iterable[tuple[int, bytes]]) -> Iterator[tuple[int, bytes]]:
        group: list[tuple[int, bytes]] = []
        size = 0
        for number, raw in source:
            if (number - 1) // CHUNK_LINES in self.done_chunks:
                yield number, b""  # queued by an earlier pass: the backlog reads its index instead
                continue
            group.append((number, raw))
            size += len(raw)
            if len(group) >= _GROUP_LINES or size >= _GROUP_BYTES:
                self.on_group()
                yield from self._translate(group)
                group, size = [], 0
        if group:
            self.on_group()
            yield from self._translate(group)

    def parse(self, number: int, raw: bytes, run_id: str, settings: Settings) -> Line | Invalid | None:
        """The backlog's `parse` for translated lines."""
        if not raw.strip():
            return None
        data = json.loads(raw)
        if INVALID in data:
            return Invalid(number, json.dumps(data[INVALID]), data.get("custom_id"))
        line = manifest.parse(number, raw, run_id, settings)
        return dataclasses.replace(line, api_key=self.api_key) if isinstance(line, Line) else line

    # ------------------------------------------------------------------ translation
    def _translate(self, group: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        read = [(number, self._read(number, raw)) for number, raw in group]
        uploads = [
            (i, item[1])
            for i, (_n, item) in enumerate(read)
            if isinstance(item, tuple) and item[1].data is not None  # an empty data: URL is checked too
        ]
        with ThreadPoolExecutor(_UPLOAD_THREADS) as pool:
            uris = dict(
                zip((i for i, _ in uploads), pool.map(self._upload, (c for _, c in uploads)), strict=True)
            )
        out: list[tuple[int, bytes]] = []
        for i, (number, item) in enumerate(read):
            if item is None:
                out.append((number, b""))
                continue
            if isinstance(item, tuple):
                custom_id, chat = item
                uri = uris.get(i, chat.image)
                if not isinstance(uri, OpenAIError):
                    out.append((number, _dumps(_manifest_line(custom_id, chat, uri))))
                    continue
                item = {**refusal(uri), "custom_id": custom_id}
            out.append((number, _dumps(_invalid(item))))
        return out

    def _read(self, number: int, raw: bytes) -> tuple[str, ChatJob] | dict[str, Any] | None:
        """The line's custom id and request, a refusal ({status, error, custom_id}), or None (blank)."""
        if len(manifest.content(raw)) > self.max_bytes:  # its ending is not counted, as the reader counts
            return _error(400, f"the line is over {self.max_bytes} bytes", None, "line_too_long")
        text = raw.strip()
        if not text:
            return None
        too_many = encoding.values_problem(text)
        if too_many:  # before any parse, custom_id_of's too (review, helper-97: 3.4 GB for one line)
            return _error(400, f"the line is {too_many}", None, "invalid_value")
        try:
            data = json.loads(text, object_pairs_hook=encoding.unique_keys)
        except encoding.DuplicateKey as twice:  # as the chat route refuses its body (review, helper-85)
            ambiguous = _error(400, f"the line is ambiguous: {twice}", None, "invalid_json")
            return self._refused(number, custom_id_of(text), ambiguous)
        except RecursionError:  # a deep line may be JSON still: say so, and answer under its id
            deep = _error(400, "the line is nested too deeply to be read", None, "invalid_json")
            return self._refused(number, _shallow_custom_id(text), deep)
        except ValueError:
            return _error(400, "the line is not JSON", None, "invalid_json")
        custom = data.get("custom_id") if isinstance(data, dict) else None
        custom_id = encoding.clean(custom) if isinstance(custom, str) else None  # as the error file writes it
        problem = encoding.unwritable(data)
        if problem:  # refused as the chat route refuses its body (read_json), naming the place in it
            where = problem.split(":", 1)[0].removeprefix("body.")
            return self._refused(number, custom_id, _error(400, problem[:300], where[:100], "invalid_value"))
        try:
            return self._request(number, data, custom_id)
        except OpenAIError as exc:
            return {**refusal(exc), "custom_id": custom_id}

    def _refused(self, number: int, custom_id: str | None, error: dict[str, Any]) -> dict[str, Any]:
        """A line refused before its request was read, answered under its custom id. The id counts
        as used: a later line naming it is a duplicate, never a second answer under the id the error
        file gives this one (review, helper-88); and a line naming an id an earlier line used is that
        duplicate, as an accepted line would be, not a second answer under it (review, helper-113)."""
        if custom_id is not None:
            first = self.seen.setdefault(custom_id, number)
            if first != number:
                error = refusal(_duplicate(custom_id, first))
        return {**error, "custom_id": custom_id}

    def _request(self, number: int, data: object, custom_id: str | None) -> tuple[str, ChatJob]:
        if custom_id is not None:
            first = self.seen.setdefault(custom_id, number)
            if first != number:
                raise _duplicate(custom_id, first)
        try:
            line = BatchLine.model_validate(data)
        except ValidationError as exc:
            first_error = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
            param = param_of(tuple(first_error.get("loc", ()))) or None
            raise OpenAIError(
                400, f"{param or 'line'}: {first_error.get('msg', 'invalid')}", param, "invalid_value"
            ) from None
        if line.url != self.endpoint:
            raise OpenAIError(
                400, f"url must be the batch's endpoint, {self.endpoint}", "url", "invalid_value"
            )
        chat = parse_chat(line.body, self.settings, batch=True, check_model=self._check_model)
        if chat.image is not None:  # what the workers may read and, for a key, what it may name
            problem = checks.source_problem(self.settings, chat.image, self.api_key)
            if problem:
                raise from_usage_error(problem, chat.image_param)
        return line.custom_id, chat

    def _check_model(self, model: str) -> None:
        if model not in self.models:
            raise OpenAIError(404, f"The model `{model[:100]}` does not exist", "model", "model_not_found")

    def _upload(self, chat: ChatJob) -> str | OpenAIError:
        assert chat.data is not None
        try:
            checks.image_bytes(self.settings, chat.data)
            return self.intake.upload_bytes(chat.data, self.api_key)[0]
        except UsageError as exc:  # the store failing is not the line's fault: it raises (a resume)
            return from_usage_error(exc.message, chat.image_param)


def custom_id_of(raw: bytes | str) -> str | None:
    """The custom_id of a line read as JSON without refusing keys given twice, as the error file
    writes it; None where the line names none, or names two different ones: json keeps the last, and
    an error line under either would answer a request the client may not have meant (review,
    helper-86). Costs about a parse: values are compared only where an object repeats a key. None for a
    line holding more values than any request (never parsed)."""
    if encoding.values_problem(raw):
        return None
    try:
        data = json.loads(raw, object_pairs_hook=_one_custom_id)
    except RecursionError:
        return _shallow_custom_id(raw)
    except ValueError:
        return None
    value = data.get("custom_id") if isinstance(data, dict) else None
    return encoding.clean(value) if isinstance(value, str) else None


def _shallow_custom_id(raw: bytes | str) -> str | None:
    """The custom_id of a line nested past what json can parse, read from its top level alone
    (review, helper-112: such a line's error had no custom_id, and a client could not tell which
    request it answered)."""
    value = encoding.top_level_string(raw, "custom_id")
    return encoding.clean(value) if value is not None else None


def _one_custom_id(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object, without its custom_id where it gives two different ones. Comparing only repeated
    keys' values keeps this linear in the line (review, helper-88: serialising every custom_id's value
    took 10 s for a 1 MB line of 980 nested objects)."""
    value = dict(pairs)
    if len(value) < len(pairs):
        given = [v for k, v in pairs if k == "custom_id"]
        if any(v != given[0] for v in given[1:]):
            del value["custom_id"]
    return value


def _duplicate(custom_id: str, first: int) -> OpenAIError:
    return OpenAIError(
        400,
        f"custom_id {custom_id[:80]!r} is used on line {first} too; each request needs its own",
        "custom_id",
        "duplicate_custom_id",
    )


def _dumps(data: dict[str, Any]) -> bytes:
    return encoding.to_bytes(data)  # a line's own text (a lone surrogate too) never stops the batch


def _error(status: int, message: str, param: str | None, code: str) -> dict[str, Any]:
    return refusal(OpenAIError(status, message, param, code))


def _invalid(item: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {INVALID: {"status": item["status"], "error": item["error"]}}
    if item.get("custom_id") is not None:
        out["custom_id"] = item["custom_id"]
    return out


def _manifest_line(custom_id: str, chat: ChatJob, uri: str | None) -> dict[str, Any]:
    line: dict[str, Any] = {"custom_id": custom_id, "image": uri, "prompt": chat.prompt}
    if chat.max_new_tokens is not None:
        line["max_new_tokens"] = chat.max_new_tokens
    if chat.ticket_id is not None:
        line["ticket_id"] = chat.ticket_id
    if chat.response_format is not None:
        line["response_format"] = chat.response_format
    if not chat.truncate:
        line["truncate"] = False
    return line
