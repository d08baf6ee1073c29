"""Runs the stages for one delivered batch and times them. Never raises for one job's fault.

decode -> claim (admission) -> prompt -> images (fetch, header checks) -> cache -> model -> results

Jobs whose last delivery died with them in hand run after the rest, one at a time, each through
every stage, so a job that kills its worker cannot take its neighbours with it again.

In the model stage, images are decoded in a thread pool in model-batch order, so while the model
runs batch N the pool decodes batch N+1 and the accelerator is not left waiting for the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from shared import logs
from shared.errors import InternalError, ModelError, MrcError, WorkerUnusable
from shared.records import JobRecords
from shared.settings import Settings
from shared.stores import ImageSource, ResultStore
from workers import batching, images, inference, stages
from workers.admission import Admission
from workers.backends.base import GenerationInput, ModelBackend
from workers.batch_sizes import BatchSizes, caps_for
from workers.cache import ResultCache, job_cache_key
from workers.finisher import Finisher, Requeue
from workers.metrics import Metrics
from workers.slots import Message, Outcome, Slot

Stage = Callable[[list[Slot]], None]

# A fault in these stages is the job store's (Redis) or the result store's, not a job's: failing the jobs
# would turn a transient outage into permanent failed results.
_INFRASTRUCTURE_STAGES = frozenset({"claim", "results"})


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
        batch_sizes: BatchSizes | None = None,
    ) -> None:
        self.backend = backend
        # None: every input length may fill MRC_MODEL_BATCH_MAX_JOBS (not measured)
        self.batch_sizes = batch_sizes or BatchSizes.fixed(
            settings.model_batch_max_jobs, settings.max_image_side
        )
        self.images_from = images_from
        self.admission = admission
        self.finisher = finisher
        self.settings = settings
        self.metrics = metrics
        self.cache = cache  # None when the cache is off (assemble decides)
        self.log = logs.get_logger()
        self._pool = ThreadPoolExecutor(
            max_workers=settings.fetch_threads,
            thread_name_prefix="mrc-fetch",
            initializer=images.init_decode_thread,
        )
        self._writes: list[Future[None]] = []
        self._busy_s = 0.0
        self.jobs_seen = 0
        self._first_batch_at: float | None = None
        self.runner = inference.Runner(backend, self._model_call)
        self._failure_streak = 0  # jobs in a row the model failed (model_error), across batches
        # For /healthz (workers/liveness.py): when the batch in hand last moved, and since when it is
        # in hand (None between batches). Monotonic clock.
        self.progress_at = time.monotonic()
        self.batch_since: float | None = None

    @property
    def busy_ratio(self) -> float:
        """Share of wall time since the first batch that the model was generating."""
        if self._first_batch_at is None:
            return 0.0
        return self._busy_s / max(1e-9, time.perf_counter() - self._first_batch_at)

    @property
    def batch_for_s(self) -> float | None:
        """How long the batch in hand has run; None between batches."""
        since = self.batch_since
        return None if since is None else time.monotonic() - since

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- run
    def run(self, messages: Sequence[Message]) -> list[Outcome]:
        self.batch_since = self.progress_at = time.monotonic()
        try:
            return self._run(messages)
        finally:
            self.batch_since, self.progress_at = None, time.monotonic()

    def _run(self, messages: Sequence[Message]) -> list[Outcome]:
        start = time.time()
        slots = [Slot(m.request_id, m.body, start) for m in messages]
        self.jobs_seen += len(slots)
        spent: dict[str, float] = {}
        self._stage("decode", self._decode, slots, spent)
        self._stage("claim", self.admission.admit, slots, spent)
        self._run_jobs([s for s in slots if not s.suspect], spent)
        for slot in slots:
            if slot.suspect:
                if slot.live:
                    self.admission.start_alone(slot)
                self._run_jobs([slot], spent)
        self.metrics.batch_jobs.observe(len(slots))
        self.log.info(
            "MRC_BATCH",
            jobs=len(slots),
            succeeded=sum(s.outcome == "succeeded" for s in slots),
            failed=sum(s.outcome == "failed" for s in slots),
            skipped=sum(s.outcome == "skipped" for s in slots),
            alone=sum(s.suspect for s in slots),
            seconds=round(time.time() - start, 4),
            stages=",".join(f"{name}:{seconds * 1000:.1f}" for name, seconds in spent.items()),
        )
        return [slot.outcome or "failed" for slot in slots]

    def _run_jobs(self, slots: list[Slot], spent: dict[str, float]) -> None:
        stages: list[tuple[str, Stage]] = [
            ("prompt", self._plan_prompts),
            ("images", self._fetch_images),
            ("cache", self._look_up_cache),
            ("model", self._infer),
            ("results", self._write_results),
        ]
        for name, stage in stages:
            self._stage(name, stage, slots, spent)

    def _stage(self, name: str, stage: Stage, slots: list[Slot], spent: dict[str, float]) -> None:
        began = time.perf_counter()
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
        self.progress_at = time.monotonic()
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
        for slot, (result, seconds) in zip(live, self._pool.map(self._fetch_one, live), strict=True):
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
                self.backend, self.settings, slot.job.max_new_tokens, slot.encoded.sha256, slot.plan
            )
        try:
            hits = self.cache.get_many([str(slot.cache_key) for slot in live])
        except Exception as exc:  # a cache that is down costs GPU time, never a job
            self.log.warning("MRC_CACHE_READ_FAILED", jobs=len(live), error=repr(exc)[:300])
            hits = [None] * len(live)
        for slot, hit in zip(live, hits, strict=True):
            self.metrics.cache.labels(result="hit" if hit else "miss").inc()
            if hit is not None:
                slot.text, slot.output_tokens, slot.cache_hit = (
                    str(hit["text"]),
                    int(hit["output_tokens"]),
                    True,
                )

    def _decode_one(self, slot: Slot) -> tuple[images.DecodedImage | MrcError, float]:
        encoded = slot.encoded
        assert encoded is not None
        return stages.timed("image decode", partial(stages.decode_image, encoded, self.backend))

    def _cost(self, slot: Slot) -> batching.Cost:
        assert slot.encoded is not None
        assert slot.plan is not None
        assert slot.job is not None
        image = self.backend.image_tokens(slot.encoded.height, slot.encoded.width)
        return batching.Cost(image + slot.plan.tokens, slot.job.max_new_tokens)

    def _infer(self, slots: list[Slot]) -> None:
        live = self._live(slots)
        if not live:
            return
        if self._first_batch_at is None:
            self._first_batch_at = time.perf_counter()
        costs = [self._cost(s) for s in live]
        lanes = [0 if s.job is not None and s.job.lane == "interactive" else 1 for s in live]
        settings = self.settings
        groups = batching.form_batches_by_lane(
            costs,
            lanes,
            caps_for(self.batch_sizes),
            settings.batch_token_budget,
            settings.batch_max_padding,
        )
        # Queue every decode now, in batch order: the pool works ahead while the model runs.
        pending = [[(live[i], self._pool.submit(self._decode_one, live[i])) for i in g] for g in groups]
        for group, decodes in zip(groups, pending, strict=True):
            members = []
            for slot, future in decodes:
                decoded, seconds = future.result()
                slot.timings["preprocess"] += seconds * 1000
                if isinstance(decoded, MrcError):
                    slot.error = decoded
                else:
                    slot.decoded = decoded
                    members.append(slot)
            inputs = [costs[i].input_tokens for i in group]
            self.metrics.padding.observe(batching.waste(inputs))
            self.metrics.model_batch_jobs.observe(len(group))
            self.metrics.model_batch_tokens.observe(max(inputs) * len(group))
            if members:
                self._generate(members)
            # This batch's results are written by the pool while the model runs the next batch.
            self._finish_async([live[i] for i in group])
        self.metrics.busy_ratio.set(self.busy_ratio)

    def _generate(self, group: list[Slot]) -> None:
        """Run one model batch (split on failure); each job gets its output or its own error."""
        inputs = []
        for slot in group:
            assert slot.decoded is not None
            assert slot.plan is not None
            assert slot.job is not None
            plan = slot.plan
            inputs.append(GenerationInput(slot.decoded.tensor, plan.text, slot.job.max_new_tokens, plan.ids))
        runs, errors = self.runner.run(inputs)
        for run in runs:
            lengths = {self._cost(group[index]).input_tokens for index in run.members}
            path = "causal" if len(lengths) == 1 else "masked"  # rows of unequal length are padded
            self.batch_sizes.observe(max(lengths), len(run.members), run.prepare_s + run.run_s)
            for index, output in zip(run.members, run.outputs, strict=True):
                group[index].attention_path = path
                slot = group[index]
                slot.text = output.text
                slot.output_tokens = output.output_tokens
                slot.timings["preprocess"] += run.prepare_s * 1000
                slot.timings["inference"] = run.run_s * 1000
        for index, error in errors.items():
            group[index].error = error
        self._watch_failures(len(runs) > 0, [e for e in errors.values() if isinstance(e, ModelError)])

    def _watch_failures(self, any_succeeded: bool, model_errors: list[ModelError]) -> None:
        """A model that fails job after job is the worker's fault, not the jobs': stop taking work
        (the delivery goes back to the queue) rather than fail every job in the lane."""
        if any_succeeded:  # the model works: this batch's failures are its jobs'
            self._failure_streak = 0
            return
        self._failure_streak += len(model_errors)
        if self._failure_streak >= self.settings.model_failure_streak:
            raise WorkerUnusable(
                f"the model failed {self._failure_streak} jobs in a row; last: {model_errors[-1].message}"
            )

    def _model_call(self, jobs: int, prepare_s: float, run_s: float, failure: BaseException | None) -> None:
        self.progress_at = time.monotonic()
        self._busy(run_s)
        if failure is not None:
            if jobs > 1:
                self.log.warning("MRC_BATCH_SPLIT", jobs=jobs, error=repr(failure)[:300])
            return
        self.log.info("MRC_MODEL_BATCH", jobs=jobs, prepare_ms=round(prepare_s * 1000, 1),
                      run_ms=round(run_s * 1000, 1))  # fmt: skip

    def _busy(self, seconds: float) -> None:
        self._busy_s += seconds
        self.metrics.model_busy.inc(seconds)

    def _write_results(self, slots: list[Slot]) -> None:
        """Write what the model stage has not already sent off, then wait for every write."""
        self._finish_async([s for s in slots if s.outcome != "skipped"])
        pending, self._writes = self._writes, []
        for future in pending:
            future.result()

    def _finish_async(self, slots: list[Slot]) -> None:
        for slot in slots:
            if not slot.finishing:
                slot.finishing = True
                self._writes.append(self._pool.submit(self.finisher.finish, slot))

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
    batch_sizes: BatchSizes | None = None,
    worker: str = "",
) -> Pipeline:
    """A pipeline wired from the seams: the worker's composition root, and the tests'."""
    metrics = metrics or Metrics()
    cache = cache if settings.cache_ttl_s > 0 else None
    log = logs.get_logger()
    finisher = Finisher(backend, results, records, settings, metrics, log, requeue, sleep, cache)
    admission = Admission(records, results, settings, metrics, log, worker)
    return Pipeline(backend, images_from, admission, finisher, settings, metrics, cache, batch_sizes)
