"""What one job asks for, as every surface hands it to the intake."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.jobs import Lane
from shared.response_format import ChoiceFormat, JsonSchemaFormat


@dataclass(frozen=True)
class Submission:
    """What one job asks for, before it has an image URI."""

    image: str | Path
    prompt: str
    job_id: str | None = None
    lane: Lane = "interactive"
    max_new_tokens: int | None = None
    ticket_id: str | None = None
    deadline: str | None = None
    # Structured answers: {"type": "json_schema", "schema": {...}} or {"type": "choice", "choices": [...]}
    response_format: Mapping[str, Any] | JsonSchemaFormat | ChoiceFormat | None = None
    # The mrc-api key's id (Job.api_key): the job lives in that key's namespace (its id, its upload;
    # shared/tenants.py) and its usage counts to it. None: `mrc submit`, Python callers, no keys.
    api_key: str | None = None
    stream: bool = False  # publish the text as it is decoded (a streamed chat request)
    truncate: bool = True  # False: never cut at MRC_MAX_PROMPT_TOKENS (prompt_too_long instead)
