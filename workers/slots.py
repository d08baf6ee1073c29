"""The unit of work inside a worker: one delivered message, and one job's state on its way through."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

from shared import encoding
from shared.errors import MrcError
from shared.jobs import JOB_ID_RE, Job
from workers import images
from workers.backends.base import PromptPlan

Outcome = Literal["succeeded", "failed", "skipped", "retry", "unwritten"]


@dataclass(frozen=True)
class Message:
    """One delivered request, as the task hands it over: the Celery task id and the `job` argument."""

    request_id: str
    body: object


@dataclass
class Slot:
    """One job's state on its way through the pipeline."""

    request_id: str
    body: object
    received: float
    job: Job | None = None
    error: MrcError | None = None
    outcome: Outcome | None = None
    attempts: int = 1
    encoded: images.EncodedImage | None = None  # its bytes dropped once decoded (without_bytes)
    # The decoded image's size: all the result needs of it. The decoded tensor itself is never kept
    # here (workers/model_stage.py): on a GPU it is the full image on the device until its row's
    # inputs are built, and a slot lives as long as its delivery.
    decoded_size: images.ImageSize | None = None
    plan: PromptPlan | None = None
    text: str | None = None
    output: Any = None  # the answer read as its response_format asked (parsed JSON, or the choice)
    output_tokens: int = 0
    # Cache positions its prefill filled (image + prompt + the model's control tokens): the engine row's
    # prompt_tokens, or the cached answer's; None when the model never took it (its usage reports 0).
    prompt_positions: int | None = None
    cached_positions: int = 0  # of those, positions reused from the engine's prefix cache, not computed
    timings: dict[str, float] = field(default_factory=lambda: {"preprocess": 0.0, "inference": 0.0})
    finishing: bool = False
    suspect: bool = False  # its last delivery died with it in hand: it runs apart, in a group
    group: str | None = None  # the engine group it runs in (suspects): nothing else runs beside it
    group_size: int = 0  # that group's size (1: a lone run)
    lone_counted: bool = False  # its lone run counted as its group began (workers/admission.py)
    solo_runs: int = 0  # earlier runs of it alone that never finished
    suspect_group: int = 0  # the size of the group it last started in as a suspect (0: never)
    attention_path: str | None = None  # causal (it decoded alone) or masked (beside other rows)
    finish_reason: str | None = None  # stop (end-of-text) or length (max_new_tokens)
    admitted_at: float | None = None  # wall clock: admitted to the engine's running batch
    first_token_at: float | None = None  # wall clock: its first token generated

    cache_key: str | None = None
    cache_hit: bool = False

    @property
    def live(self) -> bool:
        """Still on its way to the model: not failed, not finished, not answered from the cache."""
        return self.error is None and self.outcome is None and self.text is None

    @property
    def job_id(self) -> str:
        if self.job is not None:
            return self.job.job_id
        claimed = self.body.get("job_id") if isinstance(self.body, dict) else None
        if isinstance(claimed, str) and JOB_ID_RE.match(claimed):  # a malformed job's own id
            return claimed
        if JOB_ID_RE.match(self.request_id):
            return self.request_id
        # Any text a foreign message may carry (a lone surrogate too): hashing it must never raise.
        return "invalid-" + hashlib.sha256(encoding.encode(self.request_id)).hexdigest()[:24]
