"""Runs the stages for one delivered batch and times them. Never raises for one job's fault.

decode -> claim (admission) -> prompt -> images (fetch, header checks) -> cache -> model -> results

Jobs whose last delivery died with them in hand (suspects) run after the rest, in groups that each
have the engine to themselves (workers/admission.py `suspect_groups`: halved each time a group's
worker dies again), so a job that kills its worker cannot take its neighbours with it again; a group
of one has the whole worker to itself (workers/solo_gate.py), so a death then is its own.

The stages' work lives beside it: workers/preparing.py (messages, prompts, image fetches),
workers/cache_lookup.py, workers/model_stage.py, workers/finisher.py; workers/lane_pools.py holds
the threads, workers/in_hand.py what /healthz reads of the deliveries in hand.

The model stage (workers/model_stage.py) hands each job to the engine (workers/engine/) as soon as
its image is decoded and its inputs prepared, on the delivery's thread; the engine's own thread
admits it into the running batch at the next decode step, beside the rows of every other delivery in
hand, and hands it back the moment it finishes, when its result is written while the others still
decode. Several
deliveries run at once (the worker's threads pool), so a ticket's delivery never waits for a backlog
delivery to finish.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import TypeVar

from shared import logs
from shared.errors import InternalError
from shared.records import JobRecords
from shared.settings import Settings
from shared.stores import ImageSource, ResultStore
from workers import cache_lookup, preparing, stages
from workers.admission import Admission, suspect_groups
from workers.backends.base import ModelBackend
from workers.cache import ResultCache
from workers.finisher import Finisher, Requeue
from workers.in_hand import InHand
from workers.lane_pools import LanePools
from workers.metrics import Metrics
from workers.model_stage import ModelStage
from workers.slots import Message, Outcome, Slot
from workers.solo_gate import SoloGate
from workers.streaming import Sink, TextStreams

Stage = Callable[[list[Slot]], None]
T = TypeVar("T")

# A fault in these stages is the job store's (Redis) or the result store's, not a job's: failing the jobs
# would turn a transient outage into permanent failed results.
_INFRASTRUCTURE_STAGES = frozenset({"claim", "results"})


S3_CALLS_A_LANE = 16  # a pool of S3 round trips, its threads at most (fetches, writes, looks)


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
        streams: TextStreams | None = None,
    ) -> None:
        self.backend = backend
        self.images_from = images_from
        self.admission = admission
        self.finisher = finisher
        self.settings = settings
        self.metrics = metrics
        self.cache = cache  # None when the cache is off (assemble decides)
        self.log = logs.get_logger()
        self._pool = LanePools(settings.fetch_threads)  # decodes, beside the model: the cores decide
        # S3's round trips, a delivery's at once: its images fetched, and its results written, on
        # threads of their own, so a finished row's write never queues behind its lane's new photos
        # waiting to be decoded (sixteen 12 MP decodes are seconds here). Four at a time, as many as
        # the decode threads, a delivery of 16 waited four rounds of a real S3 for its images and four
        # more (two round trips each) for its results (review, helper-120).
        # At most S3_CALLS_A_LANE a pool, whatever MRC_BATCH_MAX_JOBS: the threads, and the sockets of
        # the one S3 client (shared/stores/s3.py MAX_S3_CONNECTIONS), stay bounded (review, helper-121).
        round_trips = max(settings.fetch_threads, min(settings.batch_max_jobs, S3_CALLS_A_LANE))
        self._fetches = LanePools(round_trips, "-fetch", decodes=False)
        self._writes = LanePools(round_trips, "-write", decodes=False)
        self._fetching = preparing.FetchesInFlight()
        self._local = threading.local()  # each delivery runs on one thread: its own pending writes
        self._lock = threading.Lock()
        self.jobs_seen = 0
        self._groups = itertools.count()  # engine group names for suspects, unique in the process
        fetch = partial(stages.fetch_image, source=images_from, settings=settings)
        self.model = ModelStage(
            backend, settings, metrics, admission, self._pool, self._finish_async, fetch, streams
        )
        self.in_hand = InHand(lambda: self.model.engine_at)  # for /healthz (workers/liveness.py)
        self.gate = SoloGate(lambda: self.model.engine.fatal, self._other_work)

    @property
    def busy_ratio(self) -> float:
        return self.model.busy_ratio

    @property
    def batch_since(self) -> float | None:
        """When the oldest delivery in hand began (monotonic); None when none is in hand."""
        return self.in_hand.since

    @property
    def progress_at(self) -> float:
        return self.in_hand.progress_at

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
        self._fetches.shutdown()
        self._writes.shutdown()
        self.admission.close()

    # ---------------------------------------------------------------- run
    def run(self, messages: Sequence[Message]) -> list[Outcome]:
        self.in_hand.begin()
        self._local.writes = []
        try:
            return self._run(messages)
        finally:
            self.in_hand.end()

    def _run(self, messages: Sequence[Message]) -> list[Outcome]:
        start = time.time()
        slots = [Slot(m.request_id, m.body, start) for m in messages]
        with self._lock:
            self.jobs_seen += len(slots)
        spent: dict[str, float] = {}
        self._stage("decode", self._decode, slots, spent)
        with self._held(self.gate.shared()):  # not during a lone run: see _run_group
            self._stage("claim", self.admission.admit, slots, spent)
            suspects = [s for s in slots if s.suspect and s.live]
            self._run_jobs([s for s in slots if s not in suspects], spent)
        for group in suspect_groups(suspects):  # each group apart, its results written before the next
            self._run_group(group, spent)
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

    def _run_group(self, group: list[Slot], spent: dict[str, float]) -> None:
        """A group of suspects; one alone has the worker to itself (workers/solo_gate.py), from the count
        of its lone run to its result, so that a death meanwhile is its own."""
        alone = len(group) == 1 and not self.admission.abandon_spent(group[0])
        with self._held(self.gate.alone() if alone else self.gate.shared()) as waited:
            if alone and waited:
                self.admission.recheck(group)  # cancelled or expired while it waited
            if alone and group[0].live:
                self.log.info(
                    "MRC_SUSPECT_ALONE", job_id=group[0].job_id, solo_runs=group[0].solo_runs,
                    waited_s=round(waited or 0.0, 3),
                )  # fmt: skip
            self.admission.start_group(group)
            name = f"suspect-{next(self._groups)}"
            for slot in group:
                slot.group = name
            try:
                self._run_jobs(group, spent)
            except Exception:  # Redis or S3 gone: the worker ends for a fault not the job's. Its death
                self.admission.group_ended(group)  # (WorkerUnusable: a BaseException) stays counted
                raise
            self.admission.group_ended(group)

    def _other_work(self, waited_s: float) -> bool:
        """Work no holder of the gate has in hand and a lone run waits for: rows a delivery left in the
        engine (a bug failed its model stage), or, for up to their limit, grammar compiles past it
        (they run on after their job failed `invalid_job`; a compile that never ends must not stall
        the worker)."""
        if not self.model.engine.idle:
            return True
        compiles = self.model.grammars.compiles.counts()
        return (
            bool(compiles["running"] + compiles["overdue"])
            and waited_s < self.settings.grammar_compile_timeout_s
        )

    @contextmanager
    def _held(self, hold: AbstractContextManager[T]) -> Iterator[T]:
        """The gate taken; while this delivery waits for it, it counts as moving with the engine (what it
        waits for is other deliveries' work: /healthz judges that)."""
        self.in_hand.moved(on_engine=True)
        with hold as held:
            self.in_hand.moved(on_engine=False)
            yield held

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
        self.in_hand.moved(on_engine=name == "model")
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
        self.in_hand.moved(on_engine=False)
        spent[name] = spent.get(name, 0.0) + seconds
        self.metrics.stage.labels(stage=name).observe(seconds)

    # ---------------------------------------------------------------- stages
    def _decode(self, slots: list[Slot]) -> None:
        preparing.read_messages(slots, self.settings)

    def _plan_prompts(self, slots: list[Slot]) -> None:
        preparing.plan_prompts(self._live(slots), self.backend, self.settings, self.metrics)

    def _fetch_images(self, slots: list[Slot]) -> None:
        live, photos = self._live(slots), self.model.photos
        preparing.fetch_images(
            live, self._fetches, self.images_from, self.settings, self.metrics, self._fetching,
            photos.kept_encoded, photos.fetched,
        )  # fmt: skip

    def _look_up_cache(self, slots: list[Slot]) -> None:
        if self.cache is not None:
            cache_lookup.look_up(
                self.cache, self.backend, self.settings, self.metrics, self.log, self._live(slots)
            )
        # An answer from the cache is written now, not after the delivery's rows: a ticket delivered
        # beside backlog jobs waited seconds for an answer it had in a millisecond. Failures (a bad
        # image, a retryable fetch) wait for the delivery's end, as the model's errors do: a delivery
        # given back unacked by a fatal error must not leave a retry's countdown copy beside its
        # given-back original (the job would run twice) or an announced failure to announce again.
        # A succeeded answer is safe: the given-back copy finds it and is skipped.
        self._finish_async([s for s in slots if s.cache_hit and not s.live and s.error is None])

    def _write_results(self, slots: list[Slot]) -> None:
        """Write what the model stage has not already sent off, then wait for every write: all of
        them, before the first failure is raised (the worker may then exit; a write still in flight
        would be cut off half done)."""
        self._finish_async([s for s in slots if s.outcome != "skipped"])
        pending, self._local.writes = self._local.writes, []
        concurrent.futures.wait(pending)
        for future in pending:
            future.result()

    def _finish_async(self, slots: list[Slot]) -> None:
        for slot in slots:
            if not slot.finishing:
                slot.finishing = True
                self._local.writes.append(self._writes.submit(slot, self.finisher.finish, slot))

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _live(slots: list[Slot]) -> list[Slot]:
        return [s for s in slots if s.live]


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
    streams: Sink | None = None,
) -> Pipeline:
    """A pipeline wired from the seams: the worker's composition root, and the tests'."""
    metrics = metrics or Metrics()
    cache = cache if settings.cache_ttl_s > 0 else None
    log = logs.get_logger()
    finisher = Finisher(backend, results, records, settings, metrics, log, requeue, sleep, cache)
    admission = Admission(records, results, settings, metrics, log, worker, finisher.settle_stored)
    publisher = None
    if streams is not None:  # streamed answers' text, published from a thread of its own
        publisher = TextStreams(
            streams, backend.detokenize, settings.stream_interval_s, backend.cleans_spaces, backend.settled
        ).start()
    return Pipeline(backend, images_from, admission, finisher, settings, metrics, cache, publisher)
