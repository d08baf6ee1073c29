"""A job's fields from an mrc-api request body: JSON, or multipart with the image as a file part.

Every field goes through one pydantic model (JobRequest) whatever the form, so the API accepts
exactly what the next step accepts: a multipart `max_new_tokens` is parsed by the same integer rule as
a JSON one (no `str.isdigit`, which says yes to "²"), and a body too deeply nested to parse is a 400.
Parsing and checking run off the event loop (`job_fields` hands them to the thread pool; a plain job's
small body is read where it arrives, in less time than the hop takes), and the
response_format is only shaped here: its size limit, then its schema, are checked with the rest of
the job (producer/intake/), so a large hostile schema never holds up other requests.
"""

from __future__ import annotations

import re
from typing import Any

import starlette.formparsers
from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shared import encoding


class JobRequest(BaseModel):
    """A job as JSON (multipart takes the same fields as form fields, and the image as a file part).
    A field it does not know is refused by name: a typo must not be silently dropped."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(description="s3://bucket/key (multipart: the image file part instead)")
    prompt: str
    job_id: str | None = None
    ticket_id: str | None = None
    lane: str = "interactive"
    # A JSON number, never "5", true or 5.0 (review, helper-84: all three ran); multipart's text is
    # read as decimal digits before the model sees it (`_form_integers`).
    max_new_tokens: int | None = Field(default=None, strict=True)
    deadline: str | None = None
    response_format: dict[str, Any] | None = Field(
        default=None,
        description='structured answers: {"type": "json_schema", "schema": {...}} or '
        '{"type": "choice", "choices": [...]} (multipart: the same object as a JSON string)',
    )

    @field_validator("response_format", mode="before")
    @classmethod
    def _multipart_json(cls, value: object) -> object:
        """A form field is a string: the format as JSON text (empty: none)."""
        if not isinstance(value, str):
            return value
        if not value.strip():
            return None
        try:
            return encoding.loads(value)
        except encoding.DuplicateKey as twice:
            raise ValueError(f"response_format: {twice}") from None
        except ValueError:
            raise ValueError("response_format: not JSON (or nested too deeply)") from None


def multipart_schema() -> dict[str, Any]:
    properties: dict[str, Any] = {name: {"type": "string"} for name in JobRequest.model_fields}
    properties["image"] = {"type": "string", "format": "binary"}
    properties["max_new_tokens"] = {"type": "integer"}
    properties["response_format"] = {"type": "string", "description": "the response_format object as JSON"}
    return {"type": "object", "required": ["image", "prompt"], "properties": properties}


class ErrorResponse(JSONResponse):
    """An error's JSON, written whatever text it quotes: a message that names what a client sent (a URL,
    an id, a model) may carry a lone surrogate, which plain UTF-8 cannot write (it was a 500)."""

    def render(self, content: Any) -> bytes:
        return encoding.to_bytes(content, separators=(",", ":"))


def error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The contract's error body, `{"error": {"code", "message"}}`: every route's 4xx and 5xx."""
    return ErrorResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def invalid_job(errors: list[Any], where: str = "body") -> JSONResponse:
    """422 `invalid_job` naming the first field pydantic or FastAPI refused."""
    first = errors[0] if errors else {}
    place = ".".join(str(part) for part in first.get("loc", ())) or where
    if first.get("type") == "extra_forbidden":
        known = ", ".join(JobRequest.model_fields)
        return error(422, "invalid_job", f"unknown field {place[:64]!r} (a job's fields: {known})")
    return error(422, "invalid_job", f"{place}: {first.get('msg', 'invalid')}"[:300])


async def job_fields(request: Request) -> tuple[dict[str, Any] | JSONResponse, bytes | None]:
    """The job's fields, and the image bytes for multipart; or the 4xx to send."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind == "multipart/form-data":
        async with request.form() as form:  # closes the uploaded parts' temporary files
            upload = form.get("image")
            if upload is None or isinstance(upload, str):
                return error(422, "invalid_job", "image: a multipart request needs a file part"), None
            extra = sorted({k for k, v in form.multi_items() if k != "image" and not isinstance(v, str)})
            if extra or len(form.getlist("image")) > 1:
                name = extra[0][:64] if extra else "image"
                return error(
                    422, "invalid_job", f"unknown file part {name!r} (one part, image, is taken)"
                ), None
            given = [k for k, _v in form.multi_items() if k != "image"]
            twice = sorted({k for k in given if given.count(k) > 1}) if len(set(given)) < len(given) else []
            if twice:  # review, helper-73: `-F prompt=one -F prompt=two` ran "two", unsaid
                return error(422, "invalid_job", f"{twice[0][:64]}: given more than once"), None
            data = await upload.read()
            fields: dict[str, Any] = {k: v for k, v in form.items() if k != "image" and isinstance(v, str)}
        fields["image"] = ""
        _form_integers(fields)
        return await run_in_threadpool(checked, fields), data
    if kind != "application/json":
        return error(415, "invalid_job", "send application/json or multipart/form-data"), None
    body = await request.body()
    if _plain(body):  # parsed in less time than the hop to a thread takes
        return parsed(body), None
    return await run_in_threadpool(parsed, body), None


# A JSON job body this small, with this few containers and members, is parsed on the event loop: a
# whole POST /v1/jobs naming an s3:// image is ~150 bytes and half a dozen members, its checks ~11 µs,
# and the hop to a thread was a tenth of its CPU (docs/benchmarks.md). Any other body goes to a thread:
# the parse's cost follows its structure more than its bytes (review, helper-119: 4 KiB of nested
# lists took 0.75 ms, and one outlier 12.7 ms).
_INLINE_BYTES = 1024
_INLINE_MARKS = 24


def _plain(body: bytes) -> bool:
    """Whether the body is small and flat enough to parse where it arrived (counted at C speed)."""
    if len(body) > _INLINE_BYTES:
        return False
    return body.count(b"{") + body.count(b"[") + body.count(b",") <= _INLINE_MARKS


_DECIMAL = re.compile(r"-?[0-9]{1,18}")


def _form_integers(fields: dict[str, Any]) -> None:
    """A multipart integer is decimal digits (an optional minus): `1_0`, `5.0`, ` 5` and `²` stay text
    and are refused by the strict model, as a JSON string would be (Python's int() took `1_0`)."""
    value = fields.get("max_new_tokens")
    if isinstance(value, str) and _DECIMAL.fullmatch(value):
        fields["max_new_tokens"] = int(value)


def _decoded(src: bytes | bytearray, codec: str) -> str:
    """A multipart field's text: bytes its charset does not decode become lone surrogates, which the
    checks refuse as not valid Unicode, as the JSON route refuses them (review, helper-84: Starlette's
    own fallback read them as Latin-1, so `caf\\xe9` ran as "café" and an encoded surrogate as
    mojibake). A charset Python does not know is read as UTF-8, the default."""
    try:
        return bytes(src).decode(codec, "surrogateescape")
    except LookupError:
        return bytes(src).decode("utf-8", "surrogateescape")


starlette.formparsers._user_safe_decode = _decoded  # its only use: multipart names, values, filenames


def parsed(body: bytes) -> dict[str, Any] | JSONResponse:
    try:
        data = encoding.loads(body)  # nesting past its bound is a ValueError
    except encoding.DuplicateKey as twice:
        return error(422, "invalid_job", f"the body is ambiguous: {twice}")
    except (encoding.PastDepth, encoding.TooMany) as past:  # invalid_job, as the contract says
        return error(422, "invalid_job", f"the body is {past}")
    except (ValueError, UnicodeDecodeError):
        return error(400, "invalid_job", "the body is not JSON (or is nested too deeply)")
    return checked(data)


def checked(data: object) -> dict[str, Any] | JSONResponse:
    problem = encoding.unwritable(data, "body")
    if problem:
        return error(422, "invalid_job", problem[:300])
    try:
        return JobRequest.model_validate(data).model_dump(by_alias=True)
    except ValidationError as exc:
        return invalid_job(list(exc.errors()))
    except RecursionError:
        return error(400, "invalid_job", "the body is nested too deeply")
