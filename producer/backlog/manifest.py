"""Backlog manifests: one JSON object a line, read as a stream, each line checked on its own.

A line: `{"custom_id": ..., "image": "s3://bucket/key" or a local path, "prompt": ...,
"max_new_tokens": optional int, "ticket_id": optional str, "response_format": optional
{"type": "json_schema", "schema": {...}} or {"type": "choice", "choices": [...]}, "truncate": optional
bool (false: a prompt past MRC_MAX_PROMPT_TOKENS fails prompt_too_long instead of being cut)}`. A line that
breaks a rule becomes an `Invalid` with its line number and the reason; it never stops the lines
after it.

Job ids: `<run_id>.<custom_id>` when the custom id fits the job-id alphabet and length, else
`<run_id>:<sha256 of the custom id, 32 hex>`. Run ids hold no `.` or `:`, so the two forms never meet,
and the same manifest under the same run id always names the same jobs (what makes a run resumable).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, TypeVar

from shared import encoding, names
from shared import response_format as response_formats
from shared.jobs import JOB_ID_RE, limit_problem, local_image_problem
from shared.response_format import ChoiceFormat, JsonSchemaFormat
from shared.settings import Settings

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")
RUN_ID_RULE = "1-64 of [A-Za-z0-9_-], starting with a letter or digit"
_FIELDS = {"custom_id", "image", "prompt", "max_new_tokens", "ticket_id", "response_format", "truncate"}
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
MAX_LINE_BYTES = 64 * 1024
# As long as any S3 key (1,024 bytes): a --from-s3 run names each object by its key (review: keys past
# 512 characters were refused, though the job id of a long custom_id is its hash anyway).
CUSTOM_ID_MAX = 1024
T = TypeVar("T")


@dataclass(frozen=True)
class Line:
    """A manifest line that passed every check that needs neither Redis nor S3."""

    number: int  # 1-based, as an editor shows it
    custom_id: str
    job_id: str
    image: str  # an s3:// URI or a local path
    prompt: str
    max_new_tokens: int | None
    ticket_id: str | None
    response_format: JsonSchemaFormat | ChoiceFormat | None = None
    api_key: str | None = None  # who asked, for the usage totals (a batch through mrc-api)
    truncate: bool = True


@dataclass(frozen=True)
class Invalid:
    number: int
    reason: str
    custom_id: str | None = None


def new_run_id() -> str:
    return f"run-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def job_id_for(run_id: str, custom_id: str) -> str:
    readable = f"{run_id}.{custom_id}"
    if JOB_ID_RE.match(readable):
        return readable
    return f"{run_id}:{hashlib.sha256(encoding.encode(custom_id)).hexdigest()[:32]}"


def read_lines(stream: IO[bytes], max_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) for every line, blank ones included (they are skipped later).

    A line never costs more than `max_bytes` of memory: past that, its first `max_bytes` + 1 bytes
    stand for it (enough for `parse` to refuse it) and the rest is read and dropped, so a file
    without newlines is never read whole."""
    number = 0
    while raw := stream.readline(max_bytes + 2):  # the limit is the line's own; its ending is not counted
        number += 1
        if len(raw) > max_bytes + 1 and not raw.endswith(b"\n"):
            while (rest := stream.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
        yield number, raw


def content(raw: bytes) -> bytes:
    """A raw line without its ending (LF, CRLF, or none at the end of the file): what counts against
    a line's limit. One ending only: a line cut at `read_lines`' bound ends in no LF, and CRs there
    are its own bytes (review, helper-90: stripping every CR passed a line over the limit whose
    bound fell on two, the rest of it dropped unread)."""
    if raw.endswith(b"\n"):
        raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
    return raw


def parse(number: int, raw: bytes, run_id: str, settings: Settings) -> Line | Invalid | None:
    """One raw line checked; None for a blank line."""
    if len(content(raw)) > MAX_LINE_BYTES:
        return Invalid(number, f"line is too long; the limit is {MAX_LINE_BYTES} bytes")
    text = raw.strip()
    if not text:
        return None
    try:
        data = encoding.loads(text)  # nesting past its bound is a ValueError, never a RecursionError
    except encoding.TooDeep as exc:  # its top level may still name the line (review, helper-112)
        named = encoding.top_level_string(text, "custom_id")
        custom_id = named if named is not None and encoding.unwritable(named) is None else None
        return Invalid(number, f"not JSON: {exc}"[:200], custom_id)
    except (ValueError, UnicodeDecodeError) as exc:
        return Invalid(number, f"not JSON: {exc}"[:200])
    if not isinstance(data, dict):
        return Invalid(number, "not a JSON object")
    unwritable = encoding.unwritable(data)
    if unwritable:  # a custom id, prompt or schema string no store could write
        return Invalid(number, unwritable)
    custom = data.get("custom_id")
    custom_id = custom if isinstance(custom, str) else None
    problem = _problem(data, settings)
    if problem:
        return Invalid(number, problem, custom_id)
    assert custom_id is not None
    return Line(
        number=number,
        custom_id=custom_id,
        job_id=job_id_for(run_id, custom_id),
        image=data["image"],
        prompt=data["prompt"],
        max_new_tokens=data.get("max_new_tokens"),
        ticket_id=data.get("ticket_id"),
        response_format=response_formats.parse(
            data.get("response_format"), settings.max_response_format_bytes
        ),
        truncate=data.get("truncate", True),
    )


def _optional_problem(data: dict[str, Any]) -> str | None:
    """What is wrong with the optional fields' types, if anything."""
    new = data.get("max_new_tokens")
    if new is not None and (isinstance(new, bool) or not isinstance(new, int)):
        return "max_new_tokens must be an integer"
    ticket = data.get("ticket_id")
    if ticket is not None and (not isinstance(ticket, str) or len(ticket) > 256):
        return "ticket_id must be a string of at most 256 characters"
    if not isinstance(data.get("truncate", True), bool):
        return "truncate must be true or false"
    return None


def _problem(data: dict[str, Any], settings: Settings) -> str | None:
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        return f"unknown field(s): {', '.join(unknown)[:100]}"
    for field in ("custom_id", "image", "prompt"):
        if field not in data:
            return f"missing field: {field}"
        if not isinstance(data[field], str):
            return f"{field} must be a string"
    if not 1 <= len(data["custom_id"]) <= CUSTOM_ID_MAX:
        return f"custom_id must be 1-{CUSTOM_ID_MAX} characters"
    new = data.get("max_new_tokens")
    problem = _optional_problem(data)
    if problem:
        return problem
    try:
        fmt = response_formats.parse(data.get("response_format"), settings.max_response_format_bytes)
    except ValueError as exc:
        return str(exc)
    problem = limit_problem(settings, data["prompt"], new, response_format=fmt)
    if problem:
        return problem
    return _image_problem(data["image"], settings)


def _image_problem(image: str, settings: Settings) -> str | None:
    if image.startswith("s3://"):
        try:
            bucket, _key = names.parse_s3_uri(image)
        except ValueError as exc:
            return str(exc)
        if bucket not in settings.readable_buckets:
            return f"image_source_forbidden: bucket {bucket!r} is not one the workers may read"
        return None
    if _URL_RE.match(image):
        return "image_source_forbidden: only local files and s3:// URIs are accepted"
    if not image or "\x00" in image:
        return "image must be an s3:// URI or a local path"
    return local_image_problem(Path(image), settings.max_image_bytes)


def from_listing(keys: Iterable[str], bucket: str, prompt: str) -> Iterator[bytes]:
    """Manifest lines for every object of a bucket listing: custom_id = the key."""
    for key in objects(keys):
        yield listing_line(key, bucket, prompt)


def objects(keys: Iterable[str]) -> Iterator[str]:
    """A listing's keys without its "folder" placeholder objects."""
    return (key for key in keys if not key.endswith("/"))


def listing_line(key: str, bucket: str, prompt: str) -> bytes:
    return json.dumps({"custom_id": key, "image": f"s3://{bucket}/{key}", "prompt": prompt}).encode()


def chunks(lines: Iterable[tuple[int, bytes]], size: int) -> Iterator[tuple[int, list[tuple[int, bytes]]]]:
    """Chunks of `size` manifest lines, numbered by position (lines 1..size are chunk 0): the same
    manifest always cuts into the same chunks, which is what a resume relies on."""
    chunk: list[tuple[int, bytes]] = []
    number = 0
    for n, raw in lines:
        if (n - 1) // size != number and chunk:
            yield number, chunk
            chunk = []
        number = (n - 1) // size
        chunk.append((n, raw))
    if chunk:
        yield number, chunk


def batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
