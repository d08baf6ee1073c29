"""`Intake`: a `Submission` becomes a checked `Job`, its image uploaded where it must be. Every
surface builds its jobs here (producer/intake/__init__.py)."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any

from producer.intake import checks
from producer.intake.request import Submission
from shared import names, prompts, tenants
from shared.errors import UsageError
from shared.jobs import Job
from shared.response_format import ChoiceFormat, JsonSchemaFormat
from shared.settings import Settings
from shared.sniff import sniff_format
from shared.stores import ImageSource

_CONTENT_TYPES = {"jpg": "image/jpeg", "png": "image/png", "webp": "image/webp", "gif": "image/gif"}


def validate(
    settings: Settings, sub: Submission, *, from_network: bool = False
) -> JsonSchemaFormat | ChoiceFormat | None:
    """Every check that needs neither Redis nor S3, nor any client of them: a bad submission is
    refused before either (UsageError); the parsed response format."""
    fmt = checks.limits(settings, sub)
    checks.lane(sub)
    checks.image_reference(settings, sub, from_network=from_network)
    # and every check the job itself makes (a deadline, a ticket id), on a stand-in for the image's
    # place (review, helper-87: `mrc submit --deadline garbage` was exit 5 with Redis away, 2 with it up)
    image = str(sub.image)
    _job(_fields(settings, sub, image if image.startswith("s3://") else "s3://stand-in/image", None, fmt))
    return fmt


def _fields(
    settings: Settings,
    sub: Submission,
    uri: str,
    digest: str | None,
    fmt: JsonSchemaFormat | ChoiceFormat | None,
) -> dict[str, Any]:
    max_new = settings.max_new_tokens_default if sub.max_new_tokens is None else sub.max_new_tokens
    return {
        "job_id": tenants.job_id(sub.api_key, sub.job_id or uuid.uuid4().hex),
        "image_uri": uri,
        "image_sha256": digest,
        "prompt": prompts.neutralise(sub.prompt),
        "lane": sub.lane,
        "max_new_tokens": max_new,
        "ticket_id": sub.ticket_id,
        "deadline": sub.deadline,
        "response_format": fmt,
        "api_key": sub.api_key,
        "stream": sub.stream,
        "truncate": sub.truncate,
    }


def _job(fields: dict[str, Any]) -> Job:
    try:
        return Job.from_message(fields)
    except Exception as exc:
        raise UsageError(str(exc)) from None


class Intake:
    def __init__(self, settings: Settings, images: ImageSource) -> None:
        self.settings, self.images = settings, images

    def validate(
        self, sub: Submission, *, from_network: bool = False
    ) -> JsonSchemaFormat | ChoiceFormat | None:
        return validate(self.settings, sub, from_network=from_network)

    def job(self, sub: Submission, data: bytes | None = None, *, from_network: bool = False) -> Job:
        """The job `sub` asks for, after every check, with `data` (the image's bytes, when the request
        carried them instead of a reference) or its local file uploaded. `from_network`: a request to
        mrc-api, which may not name local files and names only what the workers may read (and, for a
        key, what it may name). The limits come first: nothing is uploaded for a job refused anyway."""
        fmt = checks.limits(self.settings, sub)
        checks.lane(sub)
        digest: str | None = None
        if data is not None:
            checks.image_bytes(self.settings, data)
            uri, digest = self.upload_bytes(data, sub.api_key)
        else:
            checks.image_reference(self.settings, sub, from_network=from_network)
            uri = str(sub.image)
            if not uri.startswith("s3://"):  # a local file (refused above for a network request)
                uri, digest = self.upload_image(Path(uri), sub.api_key)
        return _job(_fields(self.settings, sub, uri, digest, fmt))

    def upload_image(self, path: Path, owner: str | None = None) -> tuple[str, str]:
        """Upload a local image to inputs/<sha256>.<ext> (once per content); return (uri, sha256)."""
        checks.local_image(self.settings, path)
        return self.upload_bytes(path.read_bytes(), owner)

    def upload_bytes(self, data: bytes, owner: str | None = None) -> tuple[str, str]:
        """Upload image bytes to inputs/<sha256>.<ext> (once per content; an API key's uploads to
        inputs/<owner>/<sha256>.<ext>, which no other key may name); return (uri, sha256)."""
        if len(data) > self.settings.max_image_bytes:
            raise UsageError(f"image is {len(data)} bytes; the limit is {self.settings.max_image_bytes}")
        digest = hashlib.sha256(data).hexdigest()
        ext = sniff_format(data) or "bin"
        key = names.input_key(self.settings.s3_prefix, digest, ext, owner)
        uri = self.images.put_input(data, key, _CONTENT_TYPES.get(ext, "application/octet-stream"))
        return uri, digest
