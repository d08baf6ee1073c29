"""A delivery's first stages, before the cache and the model: each message read into its job, each
prompt planned (tokenized, truncated where allowed), each image fetched on its lane's pool (header
checks included). What each does to one job is in workers/stages.py; a job's fault is its own error,
never its neighbours'."""

from __future__ import annotations

from functools import partial

from shared.errors import MrcError
from shared.settings import Settings
from shared.stores import ImageSource
from workers import images, stages
from workers.backends.base import ModelBackend
from workers.lane_pools import LanePools
from workers.metrics import Metrics
from workers.slots import Slot


def read_messages(slots: list[Slot], settings: Settings) -> None:
    for slot in slots:
        job, _seconds = stages.timed("reading the message", partial(stages.parse, slot.body))
        if isinstance(job, MrcError):
            slot.error = job
            continue
        # A job past this worker's limits is still the job: its result goes under its own id (it was
        # written under the message's task id, and the job the caller waited on stayed queued).
        slot.job = job
        refused, _seconds = stages.timed("checking the limits", partial(stages.check_limits, job, settings))
        if isinstance(refused, MrcError):
            slot.error = refused


def plan_prompts(live: list[Slot], backend: ModelBackend, settings: Settings, metrics: Metrics) -> None:
    for slot in live:
        job = slot.job
        assert job is not None
        plan, _seconds = stages.timed(
            "tokenizing the prompt", partial(stages.plan_prompt, job, backend, settings)
        )
        if isinstance(plan, MrcError):
            slot.error = plan
            continue
        slot.plan = plan
        if plan.truncated:
            metrics.prompt_truncated.inc()


def fetch_images(live: list[Slot], pool: LanePools, source: ImageSource, settings: Settings) -> None:
    def fetch(slot: Slot) -> tuple[images.EncodedImage | MrcError, float]:
        job = slot.job
        assert job is not None
        return stages.timed("image fetch", partial(stages.fetch_image, job, source, settings))

    fetches = [pool.submit(slot, fetch, slot) for slot in live]
    for slot, (result, seconds) in zip(live, (f.result() for f in fetches), strict=True):
        slot.timings["preprocess"] += seconds * 1000
        if isinstance(result, MrcError):
            slot.error = result
        else:
            slot.encoded = result
