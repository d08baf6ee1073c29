"""Runs the stages for one delivered batch and times them. Never raises for one job's fault.

decode -> claim (admission) -> prompt -> images (fetch, header checks) -> cache -> model -> results

Jobs whose last delivery died with them in hand run after the rest, one at a time, each through
every stage, and alone in the engine, so a job that kills its worker cannot take its neighbours
with it again.

The model stage (workers/model_stage.py) hands each job to the engine (workers/engine/) as soon as
its image is decoded and its inputs prepared, on the delivery's thread; the engine's own thread
admits it into the running batch at the next decode step, beside the rows of every other delivery in
hand, and hands it back the moment it finishes, when its result is written while the others still
decode. Several
deliveries run at once (the worker's threads pool), so a ticket's delivery never waits for a backlog
delivery to finish.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from shared import logs, names
from shared.errors import InternalError, MrcError
from shared.records import JobRecords
from shared.response_format import read_output
from shared.settings import Settings
from shared.stores import ImageSource, ResultStore
from workers import images, stages
from workers.admission import Admission, suspect_groups
from workers.backends.base import ModelBackend
from workers.cache import ResultCache, job_cache_key
from workers.finisher import Finisher, Requeue
from workers.metrics import Metrics
from workers.model_stage import ModelStage
from workers.slots import Message, Outcome, Slot

Stage = Callable[[list[Slot]], None]
T = TypeVar("T")

# A fault in these stages is the job store's (Redis) or the result store's, not a job's: failing the jobs
# would turn a transient outage into permanent failed results.
_INFRASTRUCTURE_STAGES = frozenset({"claim", "results"})


class LanePools:
    """The threads that fetch, decode and write results, one pool per lane: a ticket's image is never
    decoded behind the sixteen of a backlog delivery that arrived just before it."""

    def __init__(self, threads: int) -> None:
        self.pools = {
            lane: ThreadPoolExecutor(
                threads, thread_name_prefix=f"mrc-{lane}", initializer=images.init_decode_thread
            )
            for lane in names.LANES
        }

    def submit(self, slot: Slot, work: Callable[..., T], *args: Any) -> Future[T]:
        lane = slot.job.lane if slot.job is not None else "interactive"
        return self.pools.get(lane, self.pools["interactive"]).submit(work, *args)

    def shutdown(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Delivery:
    since: float
    at: float
    on_engine: bool = False


class Pipeline:
    """Orders, times and overlaps the stages of one delivery; the parts come in ready-made
    (`assemble` below builds them from the seams)."""

    def __init__(
        self,
        backend: ModelBackend,
        images_from: ImageSource,
        admission: Admission,
        finisher: Finisher,
        settings: Settings,
        metrics: Metrics,
        cache: ResultCache | None = None,
    ) -> None:
        self.backend = backend
        self.images_from = images_from
        self.admission = admission
        self.finisher = finisher
        self.settings = settings
        self.metrics = metrics
        self.cache = cache  # None when the cache is off (assemble decides)
        self.log = logs.get_logger()
        self._pool = LanePools(settings.fetch_threads)
        self._local = threading.local()  # each delivery runs on one thread: its own pending writes
        self._lock = threading.Lock()
        self.jobs_seen = 0
        self._groups = itertools.count()  # engine group names for suspects, unique in the process
        self.model = ModelStage(backend, settings, metrics, admission, self._pool, self._finish_async)
        # For /healthz (workers/liveness.py), monotonic clock: per delivery in hand (by thread), when
        # it began, when it last moved (a stage ended), and whether it waits on the engine (then each
        # engine step is its progress too).
        self._idle_since = time.monotonic()
        self._in_hand: dict[int, _Delivery] = {}

    @property
    def busy_ratio(self) -> float:
        return self.model.busy_ratio

    @property
    def batch_since(self) -> float | None:
        """When the oldest delivery in hand began (monotonic); None when none is in hand."""
        with self._lock:
            return min((d.since for d in self._in_hand.values()), default=None)

    @property
    def progress_at(self) -> float:
        """When the delivery that has moved least recently last moved (a stage, or an engine step
        while it waits on the engine); between deliveries, when the last one ended."""
        with self._lock:
            deliveries = list(self._in_hand.values())
        if not deliveries:
            return self._idle_since
        engine_at = self.model.engine_at
        return min(max(d.at, engine_at) if d.on_engine else d.at for d in deliveries)

    def _moved(self, on_engine: bool | None = None) -> None:
        delivery = self._in_hand.get(threading.get_ident())
        if delivery is not None:
            delivery.at = time.monotonic()
            if on_engine is not None:
                delivery.on_engine = on_engine

    @property
    def batch_for_s(self) -> float | None:
        """How long the oldest delivery in hand has run; None between deliveries."""
        since = self.batch_since
        return None if since is None else time.monotonic() - since

    def describe(self) -> dict[str, object]:
        """What /readyz reports about the engine: its limits, fixed at start."""
        return self.model.describe()

    def live(self) -> dict[str, object]:
        """What the heartbeat adds: the engine's rows now."""
        return self.model.live()

    def close(self) -> None:
        self.model.close()
        self._pool.shutdown()

    # ---------------------------------------------------------------- run
    def run(self, messages: Sequence[Message]) -> list[Outcome]:
        key, now = threading.get_ident(), time.monotonic()
        with self._lock:
            self._in_hand[key] = _Delivery(now, now)
        self._local.writes = []
        try:
            return self._run(messages)
        finally:
            with self._lock:
                self._in_hand.pop(key, None)
            self._idle_since = time.monotonic()

    def _run(self, messages: Sequence[Message]) -> list[Outcome]:
        start = time.time()
        slots = [Slot(m.request_id, m.body, start) for m in messages]
        with self._lock:
            self.jobs_seen += len(slots)
        spent: dict[str, float] = {}
        self._stage("decode", self._decode, slots, spent)
        self._stage("claim", self.admission.admit, slots, spent)
        suspects = [s for s in slots if s.suspect and s.live]
        self._run_jobs([s for s in slots if s not in suspects], spent)
        for group in suspect_groups(suspects):  # each group apart, its results written before the next
            self.admission.start_group(group)
            name = f"suspect-{next(self._groups)}"
            for slot in group:
                slot.group = name
            self._run_jobs(group, spent)
        self.metrics.batch_jobs.observe(len(slots))
        self.log.info(
            "MRC_BATCH",
            jobs=len(slots),
            succeeded=sum(s.outcome == "succeeded" for s in slots),
            failed=sum(s.outcome == "failed" for s in slots),
            skipped=sum(s.outcome == "skipped" for s in slots),
            suspects=sum(s.suspect for s in slots),
            seconds=round(time.time() - start, 4),
            stages=",".join(f"{name}:{seconds * 1000:.1f}" for name, seconds in spent.items()),
        )
        return [slot.outcome or "failed" for slot in slots]

    def _run_jobs(self, slots: list[Slot], spent: dict[str, float]) -> None:
        stages: list[tuple[str, Stage]] = [
            ("prompt", self._plan_prompts),
            ("images", self._fetch_images),
            ("cache", self._look_up_cache),
            ("model", self.model.run),
            ("results", self._write_results),
        ]
        for name, stage in stages:
            self._stage(name, stage, slots, spent)

    def _stage(self, name: str, stage: Stage, slots: list[Slot], spent: dict[str, float]) -> None:
        began = time.perf_counter()
        self._moved(on_engine=name == "model")
        try:
            stage(slots)
        except Exception as exc:  # a bug in a stage fails the jobs still in flight, not the worker
            self.log.exception("MRC_STAGE_FAILED", stage=name, error=repr(exc))
            for slot in slots:
                if slot.live:
                    slot.error = InternalError(f"stage {name} failed: {exc!r}"[:500])
            if name in _INFRASTRUCTURE_STAGES:
                raise  # Redis or S3 gone: exit unacked and let another delivery run the jobs
        seconds = time.perf_counter() - began
        self._moved(on_engine=False)
        spent[name] = spent.get(name, 0.0) + seconds
        self.metrics.stage.labels(stage=name).observe(seconds)

    # ---------------------------------------------------------------- stages
    def _decode(self, slots: list[Slot]) -> None:
        for slot in slots:
            job, _seconds = stages.timed(
                "reading the message", partial(stages.parse, slot.body, self.settings)
            )
            if isinstance(job, MrcError):
                slot.error = job
            else:
                slot.job = job

    def _plan_prompts(self, slots: list[Slot]) -> None:
        for slot in self._live(slots):
            job = slot.job
            assert job is not None
            work = partial(stages.plan_prompt, job, self.backend, self.settings)
            plan, _seconds = stages.timed("tokenizing the prompt", work)
            if isinstance(plan, MrcError):
                slot.error = plan
                continue
            slot.plan = plan
            if plan.truncated:
                self.metrics.prompt_truncated.inc()

    def _fetch_images(self, slots: list[Slot]) -> None:
        live = self._live(slots)
        fetches = [self._pool.submit(slot, self._fetch_one, slot) for slot in live]
        for slot, (result, seconds) in zip(live, (f.result() for f in fetches), strict=True):
            slot.timings["preprocess"] += seconds * 1000
            if isinstance(result, MrcError):
                slot.error = result
            else:
                slot.encoded = result

    def _fetch_one(self, slot: Slot) -> tuple[images.EncodedImage | MrcError, float]:
        job = slot.job
        assert job is not None
        return stages.timed("image fetch", partial(stages.fetch_image, job, self.images_from, self.settings))

    def _look_up_cache(self, slots: list[Slot]) -> None:
        """A hit skips decoding, preprocessing and the model; the job still gets its own result.
        The delivery's look-ups go to the cache together (one round trip, not one per job)."""
        if self.cache is None:
            return
        live = self._live(slots)
        for slot in live:
            assert slot.job is not None
            assert slot.encoded is not None
            assert slot.plan is not None
            slot.cache_key = job_cache_key(
                self.backend, self.settings, slot.job.max_new_tokens, slot.encoded.sha256, slot.plan,
                slot.job.response_format, slot.job.api_key,
            )  # fmt: skip
        try:
            hits = self.cache.get_many([str(slot.cache_key) for slot in live])
        except Exception as exc:  # a cache that is down costs GPU time, never a job
            self.log.warning("MRC_CACHE_READ_FAILED", jobs=len(live), error=repr(exc)[:300])
            hits = [None] * len(live)
        for slot, hit in zip(live, hits, strict=True):
            hit = _usable_hit(slot, hit)
            self.metrics.cache.labels(result="hit" if hit else "miss").inc()
            if hit is not None:
                assert slot.encoded is not None
                slot.encoded = slot.encoded.without_bytes()  # never decoded: the result needs its hash
                slot.text, slot.output_tokens, slot.cache_hit = (
                    str(hit["text"]),
                    int(hit["output_tokens"]),
                    True,
                )
                reason = hit.get("finish_reason")  # absent from entries cached before the engine
                positions = hit.get("prompt_tokens")  # absent from entries cached before usage
                slot.prompt_positions = positions if isinstance(positions, int) else None
                slot.finish_reason = reason if reason in ("stop", "length") else None

    def _write_results(self, slots: list[Slot]) -> None:
        """Write what the model stage has not already sent off, then wait for every write."""
        self._finish_async([s for s in slots if s.outcome != "skipped"])
        pending, self._local.writes = self._local.writes, []
        for future in pending:
            future.result()

    def _finish_async(self, slots: list[Slot]) -> None:
        for slot in slots:
            if not slot.finishing:
                slot.finishing = True
                self._local.writes.append(self._pool.submit(slot, self.finisher.finish, slot))

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _live(slots: list[Slot]) -> list[Slot]:
        return [s for s in slots if s.live]


def _usable_hit(slot: Slot, hit: dict[str, Any] | None) -> dict[str, Any] | None:
    """A cache entry as the job will use it: a constrained job's answer read back as its format asks
    (`slot.output`); an entry that does not read is a miss (the model answers again)."""
    if hit is None or slot.job is None or slot.job.response_format is None:
        return hit
    try:
        slot.output = read_output(slot.job.response_format, str(hit["text"]))
    except (ValueError, KeyError):
        return None
    return hit


def assemble(
    backend: ModelBackend,
    images_from: ImageSource,
    results: ResultStore,
    records: JobRecords,
    settings: Settings,
    *,
    metrics: Metrics | None = None,
    requeue: Requeue | None = None,
    sleep: Callable[[float], None] = time.sleep,
    cache: ResultCache | None = None,
    worker: str = "",
) -> Pipeline:
    """A pipeline wired from the seams: the worker's composition root, and the tests'."""
    metrics = metrics or Metrics()
    cache = cache if settings.cache_ttl_s > 0 else None
    log = logs.get_logger()
    finisher = Finisher(backend, results, records, settings, metrics, log, requeue, sleep, cache)
    admission = Admission(records, results, settings, metrics, log, worker)
    return Pipeline(backend, images_from, admission, finisher, settings, metrics, cache)
