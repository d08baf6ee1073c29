"""Running one model batch: split it when it fails, so a job that breaks the model fails alone, and
name each failure: the job's (model_error), memory's (out_of_memory, retried), or the device's (the
process is unusable and ends without acking, so its jobs go to a healthy worker)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.errors import InternalError, ModelError, MrcError, OutOfMemory, WorkerUnusable
from workers import batching
from workers.backends.base import GenerationInput, GenerationOutput, ModelBackend

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


# (jobs in the call, seconds preparing, seconds running, the failure or None)
OnCall = Callable[[int, float, float, BaseException | None], None]


@dataclass(frozen=True)
class BatchRun:
    """One model call that succeeded: its members (indices into the batch) and their outputs."""

    members: tuple[int, ...]
    outputs: tuple[GenerationOutput, ...]
    prepare_s: float
    run_s: float


class Runner:
    """Runs model batches with split-on-failure; reports each call's timing through `on_call`."""

    def __init__(self, backend: ModelBackend, on_call: OnCall | None = None) -> None:
        self.backend = backend
        self.on_call: OnCall = on_call or (lambda jobs, prepare_s, run_s, failure: None)

    def run(self, inputs: Sequence[GenerationInput]) -> tuple[list[BatchRun], dict[int, MrcError]]:
        """Every input ends in exactly one of: a BatchRun that holds it, or an error for it."""
        runs: list[BatchRun] = []
        errors: dict[int, MrcError] = {}
        self._run(list(range(len(inputs))), inputs, runs, errors)
        return runs, errors

    def _run(
        self,
        members: list[int],
        inputs: Sequence[GenerationInput],
        runs: list[BatchRun],
        errors: dict[int, MrcError],
    ) -> None:
        began = time.perf_counter()
        prepare_s = 0.0
        try:
            prepared = self.backend.prepare([inputs[i] for i in members])
            prepare_s = time.perf_counter() - began
            outputs = self.backend.run(prepared)
            if len(outputs) != len(members):
                raise InternalError(f"model returned {len(outputs)} outputs for {len(members)} inputs")
        except Exception as exc:
            self.on_call(len(members), prepare_s, time.perf_counter() - began - prepare_s, exc)
            error = classify(exc)  # raises for a device fault: no split can help then
            if len(members) > 1:
                first, second = batching.halves(members)
                self._run(list(first), inputs, runs, errors)
                self._run(list(second), inputs, runs, errors)
            else:
                errors[members[0]] = error
            return
        run_s = time.perf_counter() - began - prepare_s
        self.on_call(len(members), prepare_s, run_s, None)
        runs.append(BatchRun(tuple(members), tuple(outputs), prepare_s, run_s))
