"""A delivery's first stages, before the cache and the model: each message read into its job, each
prompt planned (tokenized, truncated where allowed), each image fetched on its lane's pool (header
checks included). What each does to one job is in workers/stages.py; a job's fault is its own error,
never its neighbours'."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

from shared import tenants
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


Fetched = tuple[images.EncodedImage | MrcError, float]  # a job's fetch: its image or error, and seconds


class FetchesInFlight:
    """The image fetches running now, in every delivery in hand: a job naming an image that another
    job is fetching takes that fetch's bytes (the same bytes, not a copy) instead of a second GET. Kept
    apart per key that sent the job (no tenant's answer comes faster because another asked for the same
    object) and per lane (a ticket never waits on the backlog's threads); a fetch is forgotten as it
    ends, so a later job fetches afresh (or finds the photo kept)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[tuple[str, str, str], Future[Fetched]] = {}

    def join_or_start(
        self, name: tuple[str, str, str], start: Callable[[], Future[Fetched]]
    ) -> tuple[Future[Fetched], bool]:
        """The fetch running under `name`, or one `start` begins; and whether it was running."""
        with self._lock:
            running = self._running.get(name)
            if running is not None:
                return running, True
            future = self._running[name] = start()
        future.add_done_callback(partial(self._forget, name))
        return future, False

    def _forget(self, name: tuple[str, str, str], future: Future[Fetched]) -> None:
        with self._lock:
            if self._running.get(name) is future:
                del self._running[name]


def fetch_images(
    live: list[Slot],
    pool: LanePools,
    source: ImageSource,
    settings: Settings,
    metrics: Metrics,
    in_flight: FetchesInFlight,
    kept: Callable[[Slot], images.EncodedImage | None] = lambda _slot: None,
    fetched: Callable[[Slot], None] = lambda _slot: None,
) -> None:
    """Each job's image bytes, checked. A photo kept decoded that the job names by content is not
    fetched (`kept`: its header's facts, no bytes; workers/photos.py), and a job naming an image another
    job of its key and lane is fetching now (`in_flight`), or one of its delivery fetched, shares that
    fetch."""

    def fetch(slot: Slot) -> Fetched:
        job = slot.job
        assert job is not None
        return stages.timed("image fetch", partial(stages.fetch_image, job, source, settings))

    mine: dict[tuple[str, str, str], Future[Fetched]] = {}
    waits = []
    for slot in live:
        job = slot.job
        assert job is not None
        known = kept(slot)
        if known is not None:
            slot.encoded = known
            metrics.image_fetches.labels(result="kept").inc()
            continue
        name = (tenants.owner_of(job.job_id) or "", job.lane, job.image_uri)
        future, shared = (
            (mine[name], True)
            if name in mine
            else in_flight.join_or_start(name, partial(pool.submit, slot, fetch, slot))
        )
        mine[name] = future  # the delivery's own, shared even once it has ended
        metrics.image_fetches.labels(result="shared" if shared else "fetched").inc()
        waits.append((slot, future))
    for slot, future in waits:
        result, seconds = future.result()
        slot.timings["preprocess"] += seconds * 1000
        if isinstance(result, MrcError):
            slot.error = result
        else:
            slot.encoded = result
            fetched(slot)
