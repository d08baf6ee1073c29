"""What a request may ask for, checked without Redis or S3: each check raises UsageError naming the
problem (its message starts with the error code where one applies: `image_source_forbidden: ...`),
which every surface answers in its own way (exit 2, 422, 400)."""

from __future__ import annotations

import re
from pathlib import Path

from producer.intake.request import Submission
from shared import frames, names, tenants
from shared import response_format as response_formats
from shared.dimensions import image_size
from shared.errors import UsageError
from shared.jobs import limit_problem, local_image_problem
from shared.response_format import ChoiceFormat, JsonSchemaFormat
from shared.settings import Settings
from shared.sniff import SUPPORTED_FORMATS, sniff_format

# The error codes a refused image's message begins with ("image_too_large: ..."): the routes answer
# with that code, not `invalid_job`.
IMAGE_CODES = frozenset(
    {"image_source_forbidden", "unsupported_image_format", "image_too_large", "image_decode_error"}
)

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def response_format(settings: Settings, sub: Submission) -> JsonSchemaFormat | ChoiceFormat | None:
    """The request's response format, parsed and checked (size, schema rules, bounds)."""
    try:
        return response_formats.parse(sub.response_format, settings.max_response_format_bytes)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def limits(settings: Settings, sub: Submission) -> JsonSchemaFormat | ChoiceFormat | None:
    """The prompt, max_new_tokens, job id and response format within this deployment's limits (the
    same check the worker applies to whatever it receives); the parsed response format."""
    fmt = response_format(settings, sub)
    problem = limit_problem(settings, sub.prompt, sub.max_new_tokens, sub.job_id, fmt)
    if problem:
        raise UsageError(problem)
    return fmt


def lane(sub: Submission) -> None:
    if sub.lane not in names.LANES:
        raise UsageError(f"lane must be one of {', '.join(names.LANES)}")


def local_image(settings: Settings, path: Path) -> None:
    """A local file the producer may upload: there, a file, within the size limit."""
    problem = local_image_problem(path, settings.max_image_bytes)
    if problem:
        raise UsageError(problem)


def image_reference(settings: Settings, sub: Submission, *, from_network: bool) -> None:
    """Where the image may come from. A person or a program on the operator's machines (`mrc submit`,
    a manifest, `Client`) names a local file or an `s3://` URI; a request over the network (mrc-api)
    names only an `s3://` URI the workers may read and, for an API key, one it may name (its own
    upload or a source allowed for it: shared/tenants.py), checked here rather than by the worker
    after the job is queued. A URL of any other scheme is never fetched."""
    text = str(sub.image)
    if text.startswith("s3://"):
        problem = (
            source_problem(settings, text, sub.api_key) if from_network else readable_problem(settings, text)
        )
        if problem:
            raise UsageError(problem)
    elif from_network:
        raise UsageError("image_source_forbidden: the JSON form takes s3:// URIs; upload bytes as multipart")
    elif _URL_RE.match(text):
        raise UsageError("image_source_forbidden: only local files and s3:// URIs are accepted")
    else:
        local_image(settings, Path(text))


def readable_problem(settings: Settings, uri: str) -> str | None:
    """Why the workers could not read the image `uri`: not an S3 URI, or a bucket (or a prefix of
    it) they may not read. `mrc submit`, a manifest and `Client` are refused alike, before anything is
    queued (review: `mrc submit` queued it, for the worker to fail it)."""
    try:
        bucket, key = names.parse_s3_uri(uri)
    except ValueError as exc:
        return f"image_source_forbidden: {exc}"
    prefix = settings.image_sources.get(bucket)
    if prefix is None or not names.key_allowed(key, prefix):
        where = f"s3://{bucket}/ (under {prefix or 'any prefix'})"
        return f"image_source_forbidden: {where} is not where the workers may read images"
    return None


def source_problem(settings: Settings, uri: str, owner: str | None) -> str | None:
    """Why a request over the network may not name the image `uri`: a place the workers may not
    read, or, for a key, a place that is neither its own nor allowed for it (shared/tenants.py)."""
    problem = readable_problem(settings, uri)
    if problem:
        return problem
    if owner is None:
        return None
    return tenants.source_problem(uri, owner, settings.s3_bucket, settings.s3_prefix, settings.key_sources)


def image_bytes(settings: Settings, data: bytes) -> None:
    """Refuse, before uploading, what the worker would refuse: not an image it decodes, or more
    pixels (all frames counted) than MRC_MAX_IMAGE_PIXELS, read from the header without decoding."""
    fmt = sniff_format(data)
    if fmt is None or fmt not in SUPPORTED_FORMATS:
        raise UsageError(f"unsupported_image_format: not a supported image ({fmt or 'unknown bytes'})")
    size = image_size(data, fmt)
    if size is not None and (size[0] < 1 or size[1] < 1):  # review, helper-73: stored, then failed
        raise UsageError(f"image_decode_error: {fmt} header gives an empty image ({size[0]}x{size[1]})")
    if size is not None:
        pixels = size[0] * size[1] * frames.frame_count(data, fmt)
        if pixels > settings.max_image_pixels:
            raise UsageError(
                f"image_too_large: {size[0]}x{size[1]} ({pixels} pixels, frames counted); "
                f"the limit is {settings.max_image_pixels}"
            )
