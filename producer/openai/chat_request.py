"""A chat completion request, OpenAI's shape, read into one mrc job: what is accepted, refused and
ignored, decided field by field (docs/contract.md lists the same table). Used by
`POST /v1/chat/completions` and by every line of a batch file, so both refuse the same things with
the same answer.

Accepted: `model`, `messages` (system and developer instructions, earlier user and assistant turns,
the user's question last, one `image_url` part among them: `data:` URL, base64, or `s3://` in a
bucket the workers may read; folded into one prompt by producer/openai/chat_messages.py),
`max_tokens` / `max_completion_tokens`, `response_format` (`text`, `json_schema`, `json_object`),
`metadata` (`ticket_id` -> the job's ticket id, `job_id` -> its job id; other keys are kept nowhere),
`stream` (server-sent events, with `stream_options.include_usage`; not on a batch line).
Accepted where they change nothing for a greedy decoder: `temperature` 0, `top_p` 1, `n` 1,
penalties 0, `logprobs` false, empty `stop` / `tools` / `logit_bias`, and identifiers (`user`,
`seed`, `store`, ...). Anything else is refused by name: 400 with `param` naming it. What mrc's own
job checks refuse (prompt limits, an image source, a schema the decoder cannot enforce) is 400 too,
with mrc's own code (`invalid_job`, `image_source_forbidden`, ...), where `POST /v1/jobs` answers
422: the SDKs raise BadRequestError for every request OpenAI refuses.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from producer.intake import fetch
from producer.openai import chat_messages
from producer.openai.errors import OpenAIError
from producer.openai.protocol import MAX_MESSAGES, MAX_PARTS, ChatRequest, JsonObjectFormat, TextFormat
from shared import encoding, logs, names
from shared import response_format as response_formats
from shared.jobs import limit_problem
from shared.settings import Settings

# Schemes are case-insensitive (RFC 3986): `DATA:image/png;BASE64,` too (review, helper-86).
_DATA_URL = re.compile(
    r"^data:(?P<type>[A-Za-z0-9.+/-]*)(?P<params>(;[^;,]*)*?);base64,", re.ASCII | re.IGNORECASE
)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:", re.ASCII)
_METADATA_KEYS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512


# Values that change nothing for one greedy answer of plain text: accepted; any other value is refused.
_NO_OP: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: v == 0, "mrc decodes greedily: temperature must be 0 or absent"),
    "top_p": (lambda v: v == 1, "mrc decodes greedily: top_p must be 1 or absent"),
    "n": (lambda v: v == 1, "one answer per request: n must be 1 or absent"),
    "presence_penalty": (lambda v: v == 0, "penalties are not applied: presence_penalty must be 0"),
    "frequency_penalty": (lambda v: v == 0, "penalties are not applied: frequency_penalty must be 0"),
    "logprobs": (lambda v: v is False, "log probabilities are not returned: logprobs must be false"),
    "top_logprobs": (lambda v: v == 0, "log probabilities are not returned: top_logprobs must be 0"),
    "stop": (lambda v: v == [], "stop sequences are not supported"),
    "logit_bias": (lambda v: v == {}, "logit_bias is not supported"),
    "tools": (lambda v: v == [], "tools are not supported"),
    "tool_choice": (lambda v: v == "none", "tools are not supported: tool_choice must be none or absent"),
    "parallel_tool_calls": (lambda v: v is False, "tools are not supported"),
    "functions": (lambda v: v == [], "functions are not supported"),
    "function_call": (lambda v: v == "none", "functions are not supported"),
    "modalities": (lambda v: v == ["text"], 'mrc answers in text only: modalities must be ["text"]'),
    "service_tier": (lambda v: v in ("auto", "default"), "service_tier must be auto or default"),
    # What a stream carries (include_usage: a last chunk with the usage); nothing to do for an answer
    # that comes whole (frameworks send it on every request). Only OpenAI's own keys.
    "stream_options": (
        lambda v: (
            set(v) <= {"include_usage", "include_obfuscation"} and all(type(x) is bool for x in v.values())
        ),
        "stream_options holds include_usage and include_obfuscation (true or false) only",
    ),
    "audio": (lambda v: False, "audio output is not supported"),
    "prediction": (lambda v: False, "predicted outputs are not supported"),
    "reasoning_effort": (lambda v: False, "reasoning_effort is not supported"),
    "verbosity": (lambda v: False, "verbosity is not supported"),
    "web_search_options": (lambda v: False, "web search is not supported"),
    "prompt_cache_retention": (lambda v: False, "prompt_cache_retention is not supported"),
}
# Identifiers and switches that do not change the answer: accepted, not kept.
IGNORED = ("seed", "user", "store", "prompt_cache_key", "safety_identifier")


@dataclass(frozen=True)
class ChatJob:
    """One chat request as an mrc job's fields (its image not uploaded yet)."""

    model: str
    prompt: str
    image: str | None  # an s3:// URI, or None when the image came as bytes
    data: bytes | None  # the image from a data: URL
    max_new_tokens: int | None
    response_format: dict[str, Any] | None
    ticket_id: str | None
    job_id: str | None  # metadata.job_id
    image_param: str  # where the image was, for errors about it
    stream: bool = False  # server-sent events as the text is decoded (producer/openai/chat_stream.py)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    # A conversation (instructions or history) is never cut at MRC_MAX_PROMPT_TOKENS: its cut end would be
    # the question. Too long: prompt_too_long (400), as OpenAI refuses a conversation past its context.
    truncate: bool = True


def param_of(loc: tuple[Any, ...]) -> str:
    """pydantic's location as OpenAI writes a param (messages[0].content[1].image_url.url): the
    names of union variants and the tags of tagged unions are not fields, and are left out."""
    out, tag_next = "", False
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if tag_next:  # a tagged union's tag (text, image_url, json_schema): the variant's name
            tag_next = False
            continue
        if "[" in part or part in ("str", "list", "dict"):
            tag_next = "tagged-union" in part
            continue
        out += ("." if out else "") + part
        tag_next = part == "response_format"
    return out


def invalid(exc: ValidationError, where: str = "") -> OpenAIError:
    """A validation error as OpenAI answers it: the field named, unknown and missing ones by their codes."""
    # A union reports each variant's complaint: the deepest one names the field that is wrong.
    first = max(exc.errors(), key=lambda error: len(error.get("loc", ())))
    loc = tuple(first.get("loc", ()))
    param = ((where + ".") if where and loc else where) + param_of(loc)
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return OpenAIError(
            400, f"Unrecognized request argument supplied: {param}", param, "unknown_parameter"
        )
    if kind == "missing":
        return OpenAIError(400, f"Missing required parameter: {param}", param, "missing_required_parameter")
    message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return OpenAIError(
        400, f"Invalid value for {param or 'the request'}: {message}", param or None, "invalid_value"
    )


def _counted(body: dict[str, Any]) -> None:
    """Too many messages or parts, refused before one is validated (review: validating 1.3 million
    empty messages, a legal 43 MB body, held the API's event loop 9 s; the model's limit checks the
    count after validating them all)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    if len(messages) > MAX_MESSAGES:
        raise OpenAIError(
            400, f"Invalid value for messages: {len(messages)} messages; at most {MAX_MESSAGES}",
            "messages", "invalid_value",
        )  # fmt: skip
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and len(content) > MAX_PARTS:
            raise OpenAIError(
                400, f"Invalid value for messages[{i}].content: {len(content)} parts; at most {MAX_PARTS}",
                f"messages[{i}].content", "invalid_value",
            )  # fmt: skip


def parse_chat(
    body: object,
    settings: Settings,
    *,
    batch: bool = False,
    owner: str = "",
    check_model: Callable[[str], None] = lambda _model: None,
    before_fetch: Callable[[], None] = lambda: None,
    fetch_held: list[Callable[[], None]] | None = None,
) -> ChatJob:
    """The request checked and read; OpenAIError (400) naming the field otherwise. `check_model`
    refuses a model no worker serves before the messages are read or an image URL is fetched for it
    (review, helper-73: the fetch went out, then the answer was 404); `before_fetch` runs once
    everything else is checked, just before an image URL is fetched; `fetch_held` receives the
    release of the fetch's slot, which the caller holds until the fetched image is uploaded
    (producer/intake/fetch.py)."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object", None, "invalid_request")
    _counted(body)
    try:
        request = ChatRequest.model_validate(body)
    except ValidationError as exc:
        raise invalid(exc) from None
    for field, (allowed, why) in _NO_OP.items():
        value = getattr(request, field)
        if value is not None and not allowed(value):
            raise OpenAIError(400, f"Unsupported value for {field}: {why}", field, "unsupported_value")
    if batch and request.stream:
        raise OpenAIError(
            400,
            "Unsupported value for stream: a batch line's answer is written whole to the output file",
            "stream",
            "unsupported_value",
        )
    # Which model before what the messages hold: another model is 404 whatever they hold (review,
    # helper-92: no image gave 400 image_required), and nothing is fetched for it (helper-73).
    check_model(request.model)
    folded = chat_messages.fold(request.messages)
    prompt, prompt_param, image_param = folded.prompt, folded.prompt_param, folded.image_param
    max_new = _max_tokens(request, settings)
    fmt = _response_format(request)
    ticket_id, job_id = _metadata(request.metadata, batch)
    problem = limit_problem(settings, prompt, max_new, job_id, response_formats.parse(fmt))
    if problem:
        where = "metadata.job_id" if problem.startswith("job_id") else prompt_param
        if problem.startswith("response_format"):  # its size, or a bound max_new_tokens cannot meet
            where = "response_format.json_schema.schema"
            problem = problem.replace("response_format.schema", where)
        raise OpenAIError(400, problem, where, "invalid_job")
    uri, data = _image(folded.image.url, settings, image_param, batch, owner, before_fetch, fetch_held)
    stream, options = bool(request.stream), request.stream_options or {}
    return ChatJob(
        request.model, prompt, uri, data, max_new, fmt, ticket_id, job_id, image_param,
        stream=stream, include_usage=stream and bool(options.get("include_usage")),
        truncate=not folded.conversation,
    )  # fmt: skip


def _max_tokens(request: ChatRequest, settings: Settings) -> int | None:
    a, b = request.max_tokens, request.max_completion_tokens
    if a is not None and b is not None and a != b:
        raise OpenAIError(
            400, "max_tokens and max_completion_tokens differ; give one", "max_tokens", "invalid_value"
        )
    value = b if b is not None else a
    limit = settings.max_new_tokens_limit
    if value is not None and not 1 <= value <= limit:
        param = "max_completion_tokens" if b is not None else "max_tokens"
        raise OpenAIError(400, f"{param} must be between 1 and {limit}, got {value}", param, "invalid_value")
    return value


def _response_format(request: ChatRequest) -> dict[str, Any] | None:
    fmt = request.response_format
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat):
        return {"type": "json_schema", "schema": {"type": "object"}}
    if fmt.json_schema.schema_ is None:
        raise OpenAIError(
            400,
            "response_format.json_schema.schema is required: the answer is constrained "
            "to it while it is generated",
            "response_format.json_schema.schema",
            "missing_required_parameter",
        )
    converted = {"type": "json_schema", "schema": fmt.json_schema.schema_}
    try:
        response_formats.parse(converted)
    except ValueError as exc:
        message = str(exc).replace("response_format.schema", "response_format.json_schema.schema")
        raise OpenAIError(400, message, "response_format.json_schema.schema", "invalid_job") from None
    return converted


def _metadata(metadata: dict[str, str] | None, batch: bool) -> tuple[str | None, str | None]:
    if not metadata:
        return None, None
    check_metadata(metadata)
    ticket = metadata.get("ticket_id")
    if ticket is not None and len(ticket) > 256:
        raise OpenAIError(
            400, "metadata.ticket_id is at most 256 characters", "metadata.ticket_id", "invalid_value"
        )
    if batch and "job_id" in metadata:
        raise OpenAIError(
            400,
            "metadata.job_id: a batch names its jobs after each line's custom_id",
            "metadata.job_id",
            "unsupported_value",
        )
    return ticket, metadata.get("job_id")


def check_metadata(metadata: dict[str, str]) -> None:
    """OpenAI's limits on metadata: 16 pairs, keys of 64 characters, values of 512."""
    if len(metadata) > _METADATA_KEYS:
        raise OpenAIError(400, f"metadata holds at most {_METADATA_KEYS} pairs", "metadata", "invalid_value")
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY_CHARS or len(value) > _METADATA_VALUE_CHARS:
            raise OpenAIError(
                400,
                f"metadata keys are at most {_METADATA_KEY_CHARS} characters and values "
                f"at most {_METADATA_VALUE_CHARS}",
                f"metadata.{key[:64]}",
                "invalid_value",
            )


def _image(
    url: str,
    settings: Settings,
    param: str,
    batch: bool = False,
    owner: str = "",
    before_fetch: Callable[[], None] = lambda: None,
    fetch_held: list[Callable[[], None]] | None = None,
) -> tuple[str | None, bytes | None]:
    """(s3 URI, None) or (None, the bytes of a data: URL or of an http(s) URL from an allowed host)."""
    found = _DATA_URL.match(url)
    if found:
        return None, _data_url(url, found, settings, param)
    if url[:5].lower() == "data:":
        raise OpenAIError(
            400, "a data: URL must be base64 (data:image/png;base64,...)", param, "invalid_value"
        )
    if url.startswith("s3://"):
        try:
            bucket, key = names.parse_s3_uri(url)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param, "invalid_value") from None
        prefix = settings.image_sources.get(bucket)
        if prefix is None or not names.key_allowed(key, prefix):
            raise OpenAIError(
                400,
                f"image_source_forbidden: s3://{bucket}/ (under {prefix or 'any prefix'}) "
                "is not where the workers may read images",
                param,
                "image_source_forbidden",
            )
        return url, None
    if url.lower().startswith(("http://", "https://")) and settings.image_url_hosts:
        return None, _fetched(url, settings, param, batch, owner, before_fetch, fetch_held)
    kind = "a URL" if _URL.match(url) else "not a URL"
    if settings.image_url_hosts and _URL.match(url):  # review, helper-73: ftp:// was told of the hosts
        raise OpenAIError(
            400,
            f"image_source_forbidden: only http:// and https:// image URLs are fetched, not "
            f"{url.split(':', 1)[0][:20]}:; or send a data: URL (base64) or an s3:// URI",
            param,
            "image_source_forbidden",
        )
    raise OpenAIError(
        400,
        f"image_source_forbidden: mrc fetches no URLs ({kind}) unless MRC_IMAGE_URL_HOSTS names "
        "their host; send the image as a data: URL (base64) or an s3:// URI in the configured bucket",
        param,
        "image_source_forbidden",
    )


def _data_url(url: str, found: re.Match[str], settings: Settings, param: str) -> bytes:
    """The image of a base64 `data:` URL of an image type (review, helper-84: `data:text/plain;...`
    was taken, where OpenAI's API and the contract name `data:image/...`)."""
    kind = found["type"].lower()
    if not kind.startswith("image/"):
        raise OpenAIError(
            400,
            f"a data: URL's media type is image/... (data:image/png;base64,...), not {kind[:40] or 'none'!r}",
            param,
            "invalid_value",
        )
    encoded = url[found.end() :]
    # base64 is 4 characters per 3 bytes: a string this long decodes to more than the limit
    if len(encoded) > (settings.max_image_bytes + 2) // 3 * 4 + 4:
        raise OpenAIError(
            400, f"the image is over the limit of {settings.max_image_bytes} bytes", param, "image_too_large"
        )
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise OpenAIError(400, "the data: URL is not valid base64", param, "invalid_value") from None


def _fetched(
    url: str,
    settings: Settings,
    param: str,
    batch: bool,
    owner: str,
    before_fetch: Callable[[], None],
    held: list[Callable[[], None]] | None,
) -> bytes:
    """An http(s) image fetched by the API from a host the operator allowed (producer/intake/fetch.py):
    for a chat request only. A batch line's fetch would hold its batch's enqueue, every line's bytes
    in memory at once: refused, the line naming why."""
    if batch:
        raise OpenAIError(
            400,
            "image_source_forbidden: batch lines take data: URLs and s3:// URIs; an http(s) image URL is "
            "fetched for a chat request only (fetch it first, or upload it to the bucket)",
            param,
            "image_source_forbidden",
        )
    before_fetch()
    began = time.monotonic()
    try:
        data = fetch.fetch(url, settings, owner, held)
    except fetch.FetchRefused as refused:  # logged: an operator sees a key's refused or hanging URLs
        logs.get_logger().warning(
            "MRC_IMAGE_URL_REFUSED", owner=owner, code=refused.reason, message=refused.detail[:300],
            seconds=round(time.monotonic() - began, 3),
        )  # fmt: skip
        if isinstance(refused, fetch.FetchBusy):  # nothing fetched, nothing queued: a retry is safe
            raise OpenAIError(
                429, refused.detail, param, refused.reason, headers={"Retry-After": "2"}
            ) from None
        raise OpenAIError(400, refused.detail, param, refused.reason) from None
    logs.get_logger().info(
        "MRC_IMAGE_URL_FETCHED", owner=owner, bytes=len(data), seconds=round(time.monotonic() - began, 3)
    )
    return data


def idempotency_key(headers: Mapping[str, str]) -> str | None:
    """The request's Idempotency-Key, checked alike on every route that takes one (chat, files,
    batches): 1-255 printable ASCII characters, as the SDKs send (review: files and batches took an
    empty or non-ASCII key that chat refused)."""
    key = headers.get("idempotency-key")
    if key is not None and not (1 <= len(key) <= 255 and key.isprintable() and key.isascii()):
        raise OpenAIError(
            400, "Idempotency-Key: 1-255 printable ASCII characters", "Idempotency-Key", "invalid_value"
        )
    return key


def take_json(raw: bytearray) -> object:
    """`read_json` of a body read into `raw`, which is emptied once decoded: a chat body's image, as
    base64, is held twice at most (its text and its string), never three times with the body's bytes."""
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # as json.loads reads bytes
    except (UnicodeDecodeError, LookupError):
        raise OpenAIError(
            400, "the body is not JSON (or is nested too deeply)", None, "invalid_json"
        ) from None
    raw.clear()
    return read_json(text)


def read_json(raw: str | bytes | bytearray) -> object:
    """A request body as JSON; OpenAIError 400 when it is not, or when a string in it is not valid
    Unicode (a lone surrogate, `\\udcff` on the wire): no store, key or answer could carry it, or when
    it holds more values than any request could (refused before it is parsed)."""
    too_many = encoding.values_problem(raw)
    if too_many:
        raise OpenAIError(400, f"the body is {too_many}", None, "invalid_value")
    try:
        data = json.loads(raw, object_pairs_hook=encoding.unique_keys)
    except encoding.DuplicateKey as twice:
        raise OpenAIError(400, f"the body is ambiguous: {twice}", None, "invalid_json") from None
    except (ValueError, RecursionError):
        raise OpenAIError(
            400, "the body is not JSON (or is nested too deeply)", None, "invalid_json"
        ) from None
    problem = encoding.unwritable(data)
    if problem:
        where = problem.split(":", 1)[0]
        raise OpenAIError(400, problem[:300], None if where == "value" else where[:100], "invalid_value")
    return data
