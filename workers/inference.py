"""Naming a failed model call: the job's (model_error), memory's (out_of_memory: the engine admits
fewer rows and retries, and a job that does not fit alone is retried later), or the device's (the
process is unusable and ends without acking, so its jobs go to a healthy worker)."""

from __future__ import annotations

from shared.errors import ModelError, MrcError, OutOfMemory, WorkerUnusable

# Text of CUDA/driver errors after which the context is broken for every later call (not OOM).
_DEVICE_FATAL = (
    "cuda error",
    "cudaerror",
    "cublas_status",
    "cudnn_status",
    "cusparse_status",
    "device-side assert",
    "illegal memory access",
    "illegal instruction",
    "unspecified launch failure",
    "misaligned address",
    "launch timeout",
    "uncorrectable ecc",
    "device lost",
    "nccl error",
    "hip error",
)


def out_of_memory(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


def device_fatal(exc: BaseException) -> bool:
    """A fault after which the accelerator (its context) is unusable for every later call."""
    if out_of_memory(exc):
        return False
    text = str(exc).lower()
    return type(exc).__name__ == "AcceleratorError" or any(marker in text for marker in _DEVICE_FATAL)


def classify(exc: BaseException) -> MrcError:
    """The error a job gets for a failed model call; raises WorkerUnusable for a device fault."""
    if isinstance(exc, MrcError):
        return exc
    if out_of_memory(exc):
        return OutOfMemory(str(exc)[:500])
    if device_fatal(exc):
        raise WorkerUnusable(f"the accelerator failed: {exc!r}"[:500]) from exc
    return ModelError(f"generation failed: {exc!r}"[:500])
