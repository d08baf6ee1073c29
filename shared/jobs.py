"""The job message and the result object (docs/contract.md), with their schema versions."""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared import encoding, tenants
from shared.errors import InvalidJob, MrcError
from shared.response_format import ResponseFormat, canonical, reach_problem, size_problem
from shared.settings import Settings

JOB_SCHEMA = "mrc.job/1"
RESULT_SCHEMA = "mrc.result/1"
Lane = Literal["interactive", "backlog"]
Status = Literal["succeeded", "failed"]
State = Literal["queued", "running", "succeeded", "failed", "unknown"]

JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z")
JOB_ID_RULE = "1-128 of [A-Za-z0-9._:-], starting with a letter or digit"


def rfc3339(moment: datetime | None = None, timespec: str = "milliseconds") -> str:
    """An RFC 3339 UTC time with a Z, as results, records and log lines all write it."""
    return (moment or datetime.now(UTC)).astimezone(UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


def now_rfc3339() -> str:
    return rfc3339()


# RFC 3339's date-time: `T` or `t` (or a space, which its section 5.6 allows for readability), seconds
# always, a zone always, `Z` or `z` for UTC. Python's ISO 8601 reader took forms RFC 3339 has not
# (20300630T120000Z, 12:00Z) and refused some it has (lower case, a leap second): review.
_RFC3339 = re.compile(
    r"(\d{4}-\d{2}-\d{2})[Tt ](\d{2}:\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](?:[01]\d|2[0-3]):[0-5]\d)", re.ASCII
)


def parse_rfc3339(value: str) -> datetime:
    """An RFC 3339 date-time; ValueError for anything else. A leap second (:60) reads as :59."""
    found = _RFC3339.fullmatch(value)
    if found is None:
        raise ValueError(f"not an RFC 3339 date-time: {value[:40]!r}")
    day, minutes, seconds, fraction, zone = found.groups()
    seconds = "59" if seconds == "60" else seconds
    zone = "+00:00" if zone in ("Z", "z") else zone
    fraction = (fraction or "")[:7]  # to the microsecond, what datetime holds
    try:
        return datetime.fromisoformat(f"{day}T{minutes}:{seconds}{fraction}{zone}")
    except ValueError:  # a month 13, an hour 25: the same words as for any other non-date
        raise ValueError(f"not an RFC 3339 date-time: {value[:40]!r}") from None


def prompt_problem(prompt: str) -> str | None:
    """What makes a prompt unusable whatever the limits (empty, NUL, not Unicode), or None."""
    if not prompt.strip():
        return "prompt is empty"
    if "\x00" in prompt:
        return "prompt contains a NUL byte"
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        return "prompt is not valid Unicode (lone surrogate)"
    return None


def limit_problem(
    settings: Settings,
    prompt: str,
    max_new_tokens: int | None = None,
    job_id: str | None = None,
    response_format: ResponseFormat | None = None,
) -> str | None:
    """What puts a job outside this deployment's limits, or None: the one check the producer (before
    anything is uploaded or sent) and the worker (for whatever it receives) both apply."""
    problem = prompt_problem(prompt)
    if problem:
        return problem
    if len(prompt) > settings.max_prompt_chars:
        return f"prompt has {len(prompt)} characters; the limit is {settings.max_prompt_chars}"
    limit = settings.max_new_tokens_limit
    whole = isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool)
    if max_new_tokens is not None and not whole:
        # Client.submit(max_new_tokens="5") raised a TypeError; True and 5.0 ran (review, helper-85)
        kind = type(max_new_tokens).__name__
        return f"max_new_tokens must be a whole number, got {kind} {str(max_new_tokens)[:20]!r}"
    if max_new_tokens is not None and not 1 <= max_new_tokens <= limit:
        text = str(max_new_tokens)  # a huge one is named by its size, not by a misleading head
        got = text if len(text) <= 20 else f"a number of {len(text.lstrip('-'))} digits"
        return f"max_new_tokens must be between 1 and {limit}, got {got}"
    if job_id is not None and not JOB_ID_RE.match(job_id):
        return f"job_id {job_id[:40]!r}: {JOB_ID_RULE}"
    if response_format is not None:
        tokens = settings.max_new_tokens_default if max_new_tokens is None else max_new_tokens
        return size_problem(
            response_format, settings.max_response_format_bytes, settings.max_choices
        ) or reach_problem(response_format, tokens, settings.max_token_chars)
    return None


class Job(BaseModel):
    """One unit of work as it travels through Redis: JSON, never pickle."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_: Literal["mrc.job/1"] = Field(default="mrc.job/1", alias="schema")
    job_id: str
    image_uri: str
    image_sha256: str | None = None
    prompt: str
    lane: Lane = "interactive"
    max_new_tokens: int = Field(ge=1)
    ticket_id: str | None = Field(default=None, max_length=256)
    submitted_at: str = Field(default_factory=now_rfc3339)
    deadline: str | None = None
    response_format: ResponseFormat | None = None  # structured answers (shared/response_format.py)
    # Who submitted it through mrc-api: the key's id (the first 12 hex of its sha256), for the usage
    # totals per key; None from `mrc submit`, `mrc backlog` and an API without keys. Never part of
    # the fingerprint (the same job from two callers is the same job).
    api_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{12}$")
    # Its text is published as it is decoded (a streamed chat request; workers/streaming.py). How the
    # answer is delivered, not what it is: never part of the fingerprint.
    stream: bool = False
    # False: a prompt past MRC_MAX_PROMPT_TOKENS fails prompt_too_long even where the worker truncates
    # prompts (a folded conversation: its cut end would be the question itself).
    truncate: bool = True

    @field_validator("job_id")
    @classmethod
    def _job_id_shape(cls, value: str) -> str:
        """A client's id, or an API key's job (`<owner>~<client id>`, shared/tenants.py)."""
        if not tenants.STORED_JOB_ID_RE.match(value):
            raise ValueError(f"job_id: {JOB_ID_RULE}")
        return value

    @model_validator(mode="after")
    def _owned_by_its_key(self) -> Job:
        """A job in a key's namespace was submitted with that key: its usage and events go to it."""
        owner = tenants.owner_of(self.job_id)
        if owner is not None and owner != self.api_key:
            raise ValueError(f"job_id: {self.job_id[:40]!r} belongs to another API key's namespace")
        return self

    @field_validator("submitted_at", "deadline")
    @classmethod
    def _rfc3339(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            stamp = parse_rfc3339(value)
        except ValueError:
            raise ValueError("must be an RFC 3339 time, e.g. 2026-11-30T12:00:00Z") from None
        if stamp.tzinfo is None:
            raise ValueError("must carry a time zone (Z or +hh:mm)")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_usable(cls, value: str) -> str:
        problem = prompt_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    def to_message(self) -> dict[str, Any]:
        message = self.model_dump(by_alias=True, exclude={"response_format", "api_key", "stream", "truncate"})
        if self.stream:  # absent otherwise: messages of other jobs stay as they were
            message["stream"] = True
        if not self.truncate:
            message["truncate"] = False
        if self.api_key is not None:  # absent otherwise, as response_format: old messages unchanged
            message["api_key"] = self.api_key
        if self.response_format is not None:  # absent otherwise: messages of free jobs stay as they were
            message["response_format"] = self.response_format.model_dump(by_alias=True)
        return message

    def fingerprint(self) -> str:
        """What makes two submissions the same job (not who sent it or when): the image, the prompt,
        the generation length and the response format. One job id holds one fingerprint for life."""
        parts: list[object] = [self.image_uri, self.prompt, self.max_new_tokens]
        if self.response_format is not None:  # free jobs keep the fingerprints they always had
            parts.append(canonical(self.response_format))
        material = json.dumps(parts, ensure_ascii=False)
        return hashlib.sha256(material.encode("utf-8", "surrogatepass")).hexdigest()[:32]

    @classmethod
    def from_message(cls, data: object) -> Job:
        """Parse a message body; anything malformed or of an unknown schema is InvalidJob."""
        if not isinstance(data, dict):
            raise InvalidJob(f"job message must be a JSON object, got {type(data).__name__}")
        # What no store or log could write, or no walk could follow, is refused before anything reads it.
        problem = encoding.depth_problem(data) or encoding.unwritable(data)
        if problem:
            raise InvalidJob(problem)
        schema = data.get("schema", JOB_SCHEMA)
        if schema != JOB_SCHEMA:
            raise InvalidJob(f"unknown job schema {str(schema)[:40]!r}; this worker reads {JOB_SCHEMA}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "job"
            raise InvalidJob(f"{where}: {first.get('msg', 'invalid')}") from None


class ImageInfo(BaseModel):
    uri: str
    sha256: str | None = None
    width: int = 0
    height: int = 0


class PromptInfo(BaseModel):
    chars: int = 0
    tokens: int = 0  # tokens the model saw (after truncation)
    truncated: bool = False
    original_tokens: int = 0  # tokens before truncation


class ModelInfo(BaseModel):
    id: str
    quantization: str
    attention_backend: str | None = None
    # "causal" when the job's model batch had no padding (no attention mask), "masked" when it had.
    attention_path: str | None = None


class ErrorInfo(BaseModel):
    code: str
    message: str
    retryable: bool = False

    @classmethod
    def from_error(cls, error: MrcError) -> ErrorInfo:
        return cls(code=error.code, message=error.message, retryable=error.retryable)


class Timings(BaseModel):
    queued: float = 0.0  # submitted -> admitted to the engine's running batch
    preprocess: float = 0.0
    inference: float = 0.0  # admitted -> its last token
    first_token: float = 0.0  # submitted -> its first generated token (a cache hit: -> its answer)
    total: float = 0.0


class Usage(BaseModel):
    """What the answer took: its prompt positions (text and image, the model's control tokens
    included) and the tokens it generated (the end-of-text token excluded). A cache hit reports the
    answer it reuses; a job the model never ran reports zeros."""

    prompt_tokens: int = 0
    image_tokens: int = 0  # the image's share of prompt_tokens
    # Of prompt_tokens, positions the engine reused from an identical prefix in memory (an earlier job's:
    # the same photo from the same key, and the prompt's start; or its own paused run's), not computed;
    # all of them for a reused answer.
    cached_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class JobResult(BaseModel):
    """The one object written per job to results/<job_id>.json."""

    model_config = ConfigDict(populate_by_name=True)

    schema_: Literal["mrc.result/1"] = Field(default="mrc.result/1", alias="schema")
    job_id: str
    status: Status
    text: str | None = None
    error: ErrorInfo | None = None
    # stop: the model ended its answer; length: it reached max_new_tokens; None for failed jobs
    finish_reason: Literal["stop", "length"] | None = None
    lane: str = "interactive"
    ticket_id: str | None = None
    attempts: int = 1
    image: ImageInfo
    prompt: PromptInfo = Field(default_factory=PromptInfo)
    model: ModelInfo
    cache_hit: bool = False
    timings_ms: Timings = Field(default_factory=Timings)
    usage: Usage = Field(default_factory=Usage)
    submitted_at: str
    finished_at: str = Field(default_factory=now_rfc3339)
    # The job's response_format as submitted, and the answer read as it asked (the parsed JSON value,
    # or the chosen string); both null for free-text jobs.
    response_format: dict[str, Any] | None = None
    output: Any = None
    # Beyond the contract's fields: Job.fingerprint(), so a reused job id never overwrites this result.
    job_fingerprint: str | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json")


def local_image_problem(path: Path, limit: int) -> str | None:
    """What the producer refuses of a local image: missing, not a file, over the size limit. `mrc
    submit` and every backlog manifest line check it before anything is queued (so --strict can)."""
    try:
        if not path.is_file():
            if path.is_dir():
                return f"image path is a directory, not a file: {path}"
            if path.exists():  # a device, a FIFO, a socket (review: /dev/zero was "not found")
                return f"image path is not a regular file: {path}"
            return f"image file not found: {path}"
        size = path.stat().st_size
    except OSError as exc:
        return f"image file cannot be read: {path} ({exc.strerror})"
    if size > limit:
        return f"image is {size} bytes; the limit is {limit}"
    return None
