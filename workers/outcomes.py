"""What a finished job becomes: its result object (docs/contract.md), its log line and its metrics."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from shared.errors import AnswerIncomplete, InternalError, PromptTooLong
from shared.jobs import (
    ErrorInfo,
    ImageInfo,
    JobResult,
    ModelInfo,
    PromptInfo,
    Timings,
    Usage,
    now_rfc3339,
    parse_rfc3339,
)
from workers.backends.base import ModelBackend
from workers.metrics import Metrics, image_bucket, prompt_bucket

if TYPE_CHECKING:
    from workers.slots import Slot


def build_result(slot: Slot, backend: ModelBackend) -> JobResult:
    job = slot.job
    finished = now_rfc3339()
    submitted = job.submitted_at if job else finished
    submitted_s = parse_rfc3339(submitted).timestamp()
    total_ms = max(0.0, (parse_rfc3339(finished).timestamp() - submitted_s) * 1000)
    started = slot.admitted_at if slot.admitted_at is not None else slot.received
    queued_ms = max(0.0, (started - submitted_s) * 1000)
    size = slot.decoded_size or slot.encoded
    prompt = PromptInfo(chars=len(job.prompt) if job else 0)
    if slot.plan:
        prompt = PromptInfo(
            chars=prompt.chars,
            tokens=slot.plan.tokens,
            truncated=slot.plan.truncated,
            original_tokens=slot.plan.original_tokens,
        )
    elif isinstance(slot.error, PromptTooLong):  # refused whole: the model saw none of its tokens
        prompt = PromptInfo(chars=prompt.chars, original_tokens=slot.error.original_tokens)
    failed = slot.error is not None or slot.text is None
    error = slot.error or (InternalError("no output was produced") if failed else None)
    first_token_ms = 0.0  # no token generated (a job that failed before its answer began)
    if not failed or slot.first_token_at is not None:  # an answer cut short came too (review)
        first = slot.first_token_at if slot.first_token_at is not None else time.time()
        first_token_ms = min(total_ms, max(0.0, (first - submitted_s) * 1000))
    return JobResult(
        job_id=slot.job_id,
        status="failed" if failed else "succeeded",
        text=slot.text,  # a failed job has none, except answer_incomplete: what was generated
        response_format=job.response_format.model_dump(by_alias=True)
        if job and job.response_format
        else None,
        output=None if failed else slot.output,
        error=ErrorInfo.from_error(error) if error else None,
        finish_reason=None if failed else slot.finish_reason,  # type: ignore[arg-type]
        lane=job.lane if job else "interactive",
        ticket_id=job.ticket_id if job else None,
        attempts=slot.attempts,
        image=ImageInfo(
            uri=job.image_uri if job else "",
            # of the bytes read (used, or refused for what they are), never a claim from the URI
            sha256=slot.encoded.sha256 if slot.encoded else getattr(slot.error, "image_sha256", None),
            width=size.width if size else _refused_size(slot)[0],
            height=size.height if size else _refused_size(slot)[1],
        ),
        prompt=prompt,
        model=ModelInfo(
            id=backend.model_id,
            quantization=backend.quantization,
            attention_backend=backend.describe().get("attention_backend"),
            attention_path=slot.attention_path,
        ),
        cache_hit=slot.cache_hit,
        job_fingerprint=job.fingerprint() if job else None,
        timings_ms=Timings(
            queued=round(queued_ms, 3),
            preprocess=round(slot.timings["preprocess"], 3),
            inference=round(slot.timings["inference"], 3),
            first_token=round(first_token_ms, 3),
            total=round(total_ms, 3),
        ),
        usage=usage(slot, backend),
        submitted_at=submitted,
        finished_at=finished,
    )


def usage(slot: Slot, backend: ModelBackend) -> Usage:
    """The answer's token counts, from the engine row (its prompt positions, its generated tokens) or
    the cached answer it reuses; zeros for a job the model never took."""
    positions = slot.prompt_positions
    if positions is None and slot.cache_hit and slot.plan is not None:
        positions = slot.plan.tokens + _image_tokens(slot, backend)  # an entry cached before usage
    if positions is None:
        return Usage()
    # The tokens of the answer handed out (an incomplete structured one's too); none for a job that
    # failed without one, expired while answered say (review: billed, and counted as discarded).
    delivered = slot.error is None or isinstance(slot.error, AnswerIncomplete)
    completion = slot.output_tokens if delivered else 0
    return Usage(
        prompt_tokens=positions,
        image_tokens=min(positions, _image_tokens(slot, backend)),
        cached_tokens=positions if slot.cache_hit else min(positions, slot.cached_positions),
        completion_tokens=completion,
        total_tokens=positions + completion,
    )


def report(slot: Slot, result: JobResult, metrics: Metrics, log: Any) -> None:
    latency = result.timings_ms.total / 1000
    prompt = prompt_bucket(result.prompt.tokens)
    image = image_bucket(result.image.width or 0, result.image.height or 0)
    metrics.latency.labels(lane=result.lane, prompt_tokens=prompt, image_mp=image).observe(latency)
    timings = result.timings_ms
    for stage, ms in (("queued", timings.queued), ("preprocess", timings.preprocess),
                      ("inference", timings.inference), ("total", timings.total)):  # fmt: skip
        metrics.job_stage.labels(stage=stage).observe(ms / 1000)
    code = result.error.code if result.error else ""
    metrics.jobs.labels(status=result.status, code=code, lane=result.lane).inc()
    if result.status == "succeeded":
        log.info(
            "MRC_SUCCESS",
            job_id=result.job_id,
            lane=result.lane,
            latency=round(latency, 4),
            # The positions the model read, as the result's usage bills them (its BOS and
            # beginning-of-answer included): the log and the bill agree (review, helper-92).
            input_len=result.usage.prompt_tokens,
            output_len=slot.output_tokens,
            attempts=result.attempts,
            cache_hit=result.cache_hit,
            prompt_head=_head(slot),
        )
    else:
        assert result.error is not None
        log.warning(
            "MRC_ERROR",
            job_id=result.job_id,
            lane=result.lane,
            code=result.error.code,
            message=result.error.message,
            retryable=result.error.retryable,
            attempts=result.attempts,
            prompt_head=_head(slot),
        )


def _refused_size(slot: Slot) -> tuple[int, int]:
    """An image refused from its header (too large, say) still has the size the header gave."""
    return getattr(slot.error, "image_size", None) or (0, 0)


def _image_tokens(slot: Slot, backend: ModelBackend) -> int:
    size = slot.decoded_size or slot.encoded
    return backend.image_tokens(size.height, size.width) if size else 0


def _head(slot: Slot, chars: int = 64) -> str:
    """The start of the prompt, for operators reading logs; escaped like every value."""
    return slot.job.prompt[:chars] if slot.job else ""
