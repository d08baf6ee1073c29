"""What each per-job stage does to one job, apart from how the pipeline orders, overlaps and times
them. Each takes what it needs and returns what it made; `timed` turns a job's fault into that job's
error (a device fault excepted: that one ends the worker) and measures the work."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from typing import TypeVar

from shared import names
from shared.errors import ImageNotFound, InternalError, InvalidJob, MrcError, OutOfMemory, WorkerUnusable
from shared.jobs import Job, limit_problem
from shared.settings import Settings
from shared.stores import ImageSource
from workers import cpu_threads, images, inference
from workers.backends.base import ModelBackend, PromptPlan

T = TypeVar("T")


def timed(what: str, work: Callable[[], T]) -> tuple[T | MrcError, float]:
    """Run one job's piece of work: its result or its error, and the seconds it took."""
    began = time.perf_counter()
    result: T | MrcError
    try:
        result = work()
    except MrcError as exc:
        result = exc
    except Exception as exc:
        if inference.device_fatal(exc):  # e.g. nvjpeg on a broken CUDA context: not the job's fault
            raise WorkerUnusable(f"{what} failed on the device: {exc!r}"[:500]) from exc
        if inference.out_of_memory(exc):  # the machine's memory, not the job's fault: retried later
            result = OutOfMemory(f"{what} ran out of memory: {exc!r}"[:500])
        else:
            result = InternalError(f"{what} failed: {exc!r}"[:500])
    return result, time.perf_counter() - began


def parse(body: object) -> Job:
    """The job in a message (InvalidJob when it is not one)."""
    return Job.from_message(body)


def check_limits(job: Job, settings: Settings) -> None:
    """InvalidJob when the job asks more than this deployment allows (a producer whose limits are
    higher than this worker's: mid-rollout, or settings that differ)."""
    problem = limit_problem(settings, job.prompt, job.max_new_tokens, response_format=job.response_format)
    if problem:
        raise InvalidJob(problem)


def plan_prompt(job: Job, backend: ModelBackend, settings: Settings) -> PromptPlan:
    return backend.plan_prompt(
        job.prompt, settings.max_prompt_tokens, settings.truncate_prompts and job.truncate
    )


def fetch_image(job: Job, source: ImageSource, settings: Settings) -> images.EncodedImage:
    """The job's image bytes, checked from the header (format, size, frames, orientation). An upload's
    name is its content: bytes there of another hash are not the image the job names, whether a worker
    keeps that image or not (workers/photos.py answers a kept one by its name)."""
    data = images.fetch(source, job.image_uri, settings.image_sources, settings.max_image_bytes)
    try:
        encoded = images.inspect(data, settings.max_image_pixels)
    except MrcError as exc:  # read and refused (format, header, pixels): the result names the bytes
        exc.image_sha256 = hashlib.sha256(data).hexdigest()
        raise
    named = names.content_sha256(job.image_uri, settings.s3_bucket, settings.s3_prefix)
    if named is not None and named != encoded.sha256:
        raise ImageNotFound(  # not the job's image: its result claims no image facts (the message names them)
            f"the object at {job.image_uri[:200]} is not the upload its name says: its bytes' sha256 is "
            f"{encoded.sha256}"
        )
    return encoded


def decode_image(encoded: images.EncodedImage, backend: ModelBackend) -> images.DecodedImage:
    """Decoded (on the model's device where the decoder can), oriented, fitted by the backend, and its
    model input made where the backend makes it here; for a backend that reads no pixels, the header's
    size alone."""
    if not backend.needs_pixels:
        return images.sized(encoded)
    with cpu_threads.beside_model():  # a large model call leaves this decode a core meanwhile
        decoded = images.decode(encoded, backend.device)
        fitted = backend.fit_image(decoded.tensor)
        return dataclasses.replace(decoded, tensor=fitted, pixels=backend.image_pixels(fitted))
