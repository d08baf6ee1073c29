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


# What an allocator says when it cannot give memory: CUDA/XPU/MPS/HIP ("... out of memory"), the CPU
# allocator (`[enforce fail at alloc_cpu.cpp] ... DefaultCPUAllocator: can't allocate memory` or `not
# enough memory`, a plain RuntimeError with ENOMEM's text), C++'s `std::bad_alloc`.
_OUT_OF_MEMORY = (
    "out of memory",
    "defaultcpuallocator",
    "alloc_cpu.cpp",
    "can't allocate memory",
    "cannot allocate memory",
    "not enough memory",
    "bad_alloc",
)


def out_of_memory(exc: BaseException) -> bool:
    """Whether an allocator ran out, whichever one: the error itself or one it was raised from (a
    library that wraps the allocator's failure in its own error)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names = {cls.__name__ for cls in type(current).__mro__}
        if names & {"OutOfMemoryError", "MemoryError"}:
            return True
        text = str(current).lower()
        if any(marker in text for marker in _OUT_OF_MEMORY):
            return True
        current = current.__cause__  # `raise ... from`: said on purpose, not an error while handling one
    return False


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
