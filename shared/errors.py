"""One error tree for mrc. Each error has a stable code (docs/contract.md) and says whether retrying may
help."""

from __future__ import annotations

from typing import ClassVar


class MrcError(Exception):
    """Base of every error mrc raises on purpose."""

    code: ClassVar[str] = "internal_error"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        # The sha256 of the image bytes a job's failure was found in (read, then refused): its result
        # names them as a success's does (review: null for every failed job, even a corrupt upload's).
        self.image_sha256: str | None = None
        # Its width and height as displayed, where the header gave them before the image was refused
        # (review, helper-92: 0x0 in the result of an image refused as 8000x8000).
        self.image_size: tuple[int, int] | None = None

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message, "retryable": self.retryable}


class InvalidJob(MrcError):
    """The job message or its fields are malformed (empty prompt, bad lane, unknown schema...)."""

    code = "invalid_job"


class ImageNotFound(MrcError):
    """The image URI points at nothing."""

    code = "image_not_found"


class ImageSourceForbidden(MrcError):
    """The image URI is outside the allowed buckets, or not an S3 URI at all."""

    code = "image_source_forbidden"


class UnsupportedImageFormat(MrcError):
    """The bytes are not an image format mrc decodes (sniffed from the bytes, not the name)."""

    code = "unsupported_image_format"


class ImageDecodeError(MrcError):
    """The bytes claim a known format but cannot be decoded (truncated, corrupt)."""

    code = "image_decode_error"


class ImageTooLarge(MrcError):
    """The image exceeds the byte or pixel limit; decided from the header, before a full decode."""

    code = "image_too_large"


class PromptTooLong(MrcError):
    """The prompt exceeds the token limit and truncation is switched off."""

    code = "prompt_too_long"

    def __init__(self, message: str, original_tokens: int = 0) -> None:
        super().__init__(message)
        self.original_tokens = original_tokens  # the prompt's tokens, for its result's `prompt`


class OutOfMemory(MrcError):
    """The accelerator ran out of memory even for this job alone."""

    code = "out_of_memory"
    retryable = True


class ModelError(MrcError):
    """The model failed on this job for a reason other than memory."""

    code = "model_error"


class Expired(MrcError):
    """The job's deadline passed before it reached the model."""

    code = "expired"


class Cancelled(MrcError):
    """The job's backlog run was cancelled before the job ran."""

    code = "cancelled"


class AnswerIncomplete(MrcError):
    """A constrained answer reached max_new_tokens before its grammar was complete; the result's text
    holds what was generated. Not retryable: greedy decoding would stop at the same place."""

    code = "answer_incomplete"


class InternalError(MrcError):
    """A fault in mrc itself; the message says where."""

    code = "internal_error"


class CompilerBusy(InternalError):
    """The job's grammar could not start compiling within MRC_GRAMMAR_COMPILE_TIMEOUT_S: the worker's
    compile threads were all taken by other formats past their limit. Not the job's format's fault:
    it is retried later."""

    retryable = True


class CompileInterrupted(InternalError):
    """The process compiling the job's grammar died before it answered (a signal: the kernel's OOM
    killer, an operator): the worker's fault, not the format's. It is retried."""

    retryable = True


class Abandoned(InternalError):
    """The job killed every worker that ran it alone; it is dead-lettered so a person can requeue it."""


class StoreUnavailable(MrcError):
    """The S3 endpoint could not be reached or answered with a server error."""

    code = "internal_error"
    retryable = True


class StoreRefused(MrcError):
    """S3 refused for good what mrc needs of it (AccessDenied making the bucket: a misspelt bucket, or
    credentials that may not create it): a retry cannot help, a person must (review: it read as an
    outage, 503 and retry later)."""

    code = "internal_error"


class BucketMissing(StoreRefused):
    """A listing named a bucket that is not there: a run or batch whose index went with it, or a
    misspelt --from-s3 (review, helper-82: read as an empty listing, a lost run said "done")."""


class QueueFull(MrcError):
    """The backlog lane is at its depth limit and the caller asked not to wait (producer side only)."""

    code = "queue_full"
    retryable = True

    def __init__(self, depth: int, limit: int, then: str = "") -> None:
        said = f"queue full: the backlog lane holds {depth} jobs; the limit is {limit}"
        super().__init__(f"{said}; {then}" if then else said)
        self.depth, self.limit, self.then = depth, limit, then


class ServiceUnreachable(MrcError):
    """Redis or S3 cannot be reached or refuses us; nothing was done (exit 5 on the command line)."""

    code = "service_unreachable"
    retryable = True

    def __init__(self, service: str, detail: str) -> None:
        super().__init__(f"cannot reach {service}: {detail}"[:500])
        self.service = service


class NotReplicated(MrcError):
    """The push landed on the Redis master, but fewer replicas than MRC_REDIS_WAIT_REPLICAS confirmed
    it in time: enqueued, not yet durable (exit 6, HTTP 202 with `"replicated": false`). A failover
    now could lose it; submitting again under the same job id is the same job (producer side only)."""

    code = "not_replicated"
    retryable = True

    def __init__(self, acknowledged: int, wanted: int, timeout_ms: int, what: str = "the publish") -> None:
        self.job_id: str | None = None  # set by the producer that published it
        self.duplicate = False  # the job was published before, by an earlier submission of it
        self.job_ids: list[str] = []  # Client.submit_many: the jobs not confirmed...
        self.submitted: list[str] = []  # ...of all it enqueued
        super().__init__(
            f"enqueued, but only {acknowledged} of {wanted} Redis replicas confirmed {what} within "
            f"{timeout_ms} ms: a failover now could lose it; submit again under the same job id to make sure "
            "(the same job, never a second one)"
        )
        self.acknowledged, self.wanted = acknowledged, wanted


class PushUnconfirmed(NotReplicated):
    """The publish failed in a way that leaves open whether its push landed (a reply lost with the
    connection), and Redis could not be asked: maybe enqueued. Answered as NotReplicated (exit 6):
    resubmitting under the same job id is safe, it never queues a second message."""

    def __init__(self, cause: str) -> None:
        super().__init__(0, 0, 0)
        self.message = (
            f"the publish may have landed (its reply was lost: {cause[:200]}) and Redis could not be "
            "asked; submit again under the same job id to make sure (never a second message)"
        )


class UsageError(MrcError):
    """A caller passed bad arguments; nothing was enqueued."""

    code = "invalid_job"


class WorkerUnusable(BaseException):
    """The process can no longer run jobs (accelerator lost, CUDA context broken, a model that fails
    every job): it must end without acking, so the jobs go to a healthy worker. A BaseException, so
    the per-job handlers that turn an Exception into a job's error let it through."""


# Never in a result: the job was not enqueued.
PRODUCER_CODES: tuple[str, ...] = ("queue_full", "service_unreachable", "not_replicated")


def _codes(root: type[MrcError]) -> list[str]:
    found = [root.code]
    for sub in root.__subclasses__():
        found += _codes(sub)
    return found


# Every code a result may carry, derived from the classes above (each code once, in class order).
ERROR_CODES: tuple[str, ...] = tuple(dict.fromkeys(c for c in _codes(MrcError) if c not in PRODUCER_CODES))
