"""Runs the stages for one delivered batch and times them. Never raises for one job's fault.

decode -> claim (+ deadline) -> prompt -> images (fetch, header checks) -> model -> results

In the model stage, images are decoded in a thread pool in model-batch order, so while the model
runs batch N the pool decodes batch N+1 and the accelerator is not left waiting for the CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

from shared import logs
from shared.errors import (
    Expired,
    InternalError,
    InvalidJob,
    ModelError,
    MrcError,
    OutOfMemory,
)
from shared.jobs import Job, parse_rfc3339
from shared.records import JobRecords
from shared.settings import Settings
from shared.store import Store
from workers import batching, images, preprocess
from workers.backends.base import GenerationInput, ModelBackend
from workers.cache import ResultCache, cache_key
from workers.finisher import Finisher, Requeue
from workers.metrics import Metrics
from workers.slots import Message, Outcome, Slot

# A fault in these stages is the job store's (Redis) or the result store's, not a job's: failing the jobs
# would turn a transient outage into permanent failed results.
_INFRASTRUCTURE_STAGES = frozenset({"claim", "results"})


class Pipeline:
    def __init__(
        self,
        backend: ModelBackend,
        store: Store,
        records: JobRecords,
        settings: Settings,
        metrics: Metrics | None = None,
        sleep: Callable[[float], None] = time.sleep,
        requeue: Requeue | None = None,
        cache: ResultCache | None = None,
    ) -> None:
        self.cache = cache if settings.cache_ttl_s > 0 else None
        self.backend = backend
        self.store = store
        self.records = records
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.log = logs.get_logger()
        self.finisher = Finisher(
            backend, store, records, settings, self.metrics, self.log, requeue, sleep, self.cache
        )
        self._pool = ThreadPoolExecutor(
            max_workers=settings.fetch_threads,
            thread_name_prefix="mrc-fetch",
            initializer=images.init_decode_thread,
        )
        self._writes: list[Future[None]] = []
        self._busy_s = 0.0
        self.jobs_seen = 0
        self._first_batch_at: float | None = None

    @property
    def busy_ratio(self) -> float:
        """Share of wall time since the first batch that the model was generating."""
        if self._first_batch_at is None:
            return 0.0
        return self._busy_s / max(1e-9, time.perf_counter() - self._first_batch_at)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- run
    def run(self, messages: Sequence[Message]) -> list[Outcome]:
        start = time.time()
        slots = [Slot(m.request_id, m.body, start) for m in messages]
        self.jobs_seen += len(slots)
        stages: list[tuple[str, Callable[[list[Slot]], None]]] = [
            ("decode", self._decode),
            ("claim", self._claim),
            ("prompt", self._plan_prompts),
            ("images", self._fetch_images),
            ("cache", self._look_up_cache),
            ("model", self._infer),
            ("results", self._write_results),
        ]
        spent: dict[str, float] = {}
        for name, stage in stages:
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
            spent[name] = time.perf_counter() - began
            self.metrics.stage.labels(stage=name).observe(spent[name])
        self.metrics.batch_jobs.observe(len(slots))
        self.log.info(
            "MRC_BATCH",
            jobs=len(slots),
            succeeded=sum(s.outcome == "succeeded" for s in slots),
            failed=sum(s.outcome == "failed" for s in slots),
            skipped=sum(s.outcome == "skipped" for s in slots),
            seconds=round(time.time() - start, 4),
            stages=",".join(f"{name}:{seconds * 1000:.1f}" for name, seconds in spent.items()),
        )
        return [slot.outcome or "failed" for slot in slots]

    # ---------------------------------------------------------------- stages
    def _decode(self, slots: list[Slot]) -> None:
        for slot in slots:
            try:
                slot.job = Job.from_message(slot.body)
                limit = self.settings.max_new_tokens_limit
                if slot.job.max_new_tokens > limit:
                    raise InvalidJob(f"max_new_tokens {slot.job.max_new_tokens} exceeds {limit}")
                if len(slot.job.prompt) > self.settings.max_prompt_chars:
                    raise InvalidJob(f"prompt exceeds {self.settings.max_prompt_chars} characters")
            except MrcError as exc:
                slot.error = exc

    def _claim(self, slots: list[Slot]) -> None:
        now = datetime.now(UTC)
        for slot in slots:
            if slot.job is None:
                continue
            if self.records.get(slot.job_id).get("state") == "succeeded" and self._has_success(slot.job_id):
                slot.outcome = "skipped"
                self.metrics.duplicates.inc()
                self.log.info("MRC_SKIPPED", job_id=slot.job_id, reason="already_succeeded")
                continue
            slot.attempts = self.records.begin(slot.job_id)
            if slot.attempts > self.settings.max_attempts:
                # Delivered again and again without ever reaching a result: the job (or a neighbour)
                # keeps killing its worker. Stop the crash loop here.
                slot.error = InternalError(
                    f"abandoned after {slot.attempts - 1} deliveries that ended without a result"
                )
                continue
            deadline = self._deadline(slot.job)
            if slot.live and deadline is not None and deadline < now:
                slot.error = Expired(f"deadline {deadline.isoformat()} passed before the job ran")

    def _deadline(self, job: Job) -> datetime | None:
        """The job's own deadline, else its lane's default (MRC_DEADLINE_<LANE>_S after submission)."""
        if job.deadline:
            return parse_rfc3339(job.deadline)
        seconds = (
            self.settings.deadline_backlog_s
            if job.lane == "backlog"
            else self.settings.deadline_interactive_s
        )
        return parse_rfc3339(job.submitted_at) + timedelta(seconds=seconds) if seconds > 0 else None

    def _has_success(self, job_id: str) -> bool:
        result = self.store.get_result(job_id)
        return bool(result and result.get("status") == "succeeded")

    def _plan_prompts(self, slots: list[Slot]) -> None:
        for slot in self._live(slots):
            assert slot.job is not None
            try:
                slot.plan = self.backend.plan_prompt(
                    slot.job.prompt, self.settings.max_prompt_tokens, self.settings.truncate_prompts
                )
            except MrcError as exc:
                slot.error = exc
                continue
            except Exception as exc:  # a tokenizer fault on one prompt is that job's, not the batch's
                slot.error = InternalError(f"prompt could not be tokenized: {exc!r}"[:500])
                continue
            if slot.plan.truncated:
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
        began = time.perf_counter()
        assert slot.job is not None
        try:
            data = images.fetch(
                self.store, slot.job.image_uri, self.settings.image_sources, self.settings.max_image_bytes
            )
            return images.inspect(data, self.settings.max_image_pixels), time.perf_counter() - began
        except MrcError as exc:
            return exc, time.perf_counter() - began
        except Exception as exc:
            return InternalError(f"image fetch failed: {exc!r}"[:500]), time.perf_counter() - began

    def _look_up_cache(self, slots: list[Slot]) -> None:
        """A hit skips decoding, preprocessing and the model; the job still gets its own result."""
        if self.cache is None:
            return
        for slot in self._live(slots):
            assert slot.job is not None and slot.encoded is not None
            slot.cache_key = cache_key(
                model_id=self.backend.model_id,
                revision=self.backend.revision,
                quantization=self.backend.quantization,
                generation={
                    "decoding": "greedy",
                    "max_new_tokens": slot.job.max_new_tokens,
                    "max_prompt_tokens": self.settings.max_prompt_tokens,
                    "truncate_prompts": self.settings.truncate_prompts,
                    "max_image_side": self.settings.max_image_side,
                },
                image_sha256=hashlib.sha256(slot.encoded.data).hexdigest(),
                prompt=slot.job.prompt,
            )
            try:
                hit = self.cache.get(slot.cache_key)
            except Exception as exc:  # a cache that is down costs GPU time, never a job
                self.log.warning("MRC_CACHE_READ_FAILED", job_id=slot.job_id, error=repr(exc)[:300])
                hit = None
            self.metrics.cache.labels(result="hit" if hit else "miss").inc()
            if hit is not None:
                slot.text, slot.output_tokens, slot.cache_hit = (
                    str(hit["text"]),
                    int(hit["output_tokens"]),
                    True,
                )

    def _decode_one(self, slot: Slot) -> tuple[images.DecodedImage | MrcError, float]:
        began = time.perf_counter()
        assert slot.encoded is not None
        try:
            decoded = images.decode(slot.encoded, self.backend.device)
            if self.backend.device == "cpu":
                # On the CPU, shrink here, in parallel across the pool and off the model's critical path
                # (the same operation the device pass would do; that pass then finds nothing to shrink).
                shrunk = preprocess.resize_to_fit(decoded.tensor, self.settings.max_image_side)
                decoded = dataclasses.replace(decoded, tensor=shrunk)
            return decoded, time.perf_counter() - began
        except MrcError as exc:
            return exc, time.perf_counter() - began
        except Exception as exc:
            return InternalError(f"image decode failed: {exc!r}"[:500]), time.perf_counter() - began

    def _cost(self, slot: Slot) -> int:
        assert slot.encoded is not None and slot.plan is not None and slot.job is not None
        image = self.backend.image_tokens(slot.encoded.height, slot.encoded.width)
        return image + slot.plan.tokens + slot.job.max_new_tokens

    def _infer(self, slots: list[Slot]) -> None:
        live = self._live(slots)
        if not live:
            return
        if self._first_batch_at is None:
            self._first_batch_at = time.perf_counter()
        costs = [self._cost(s) for s in live]
        lanes = [0 if s.job is not None and s.job.lane == "interactive" else 1 for s in live]
        groups = batching.form_batches_by_lane(
            costs, lanes, self.settings.model_batch_max_jobs, self.settings.batch_token_budget
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
            self.metrics.padding.observe(batching.padding_waste([costs[i] for i in group]))
            if members:
                self._generate(members)
            # This batch's results are written by the pool while the model runs the next batch.
            self._finish_async([live[i] for i in group])
        self.metrics.busy_ratio.set(self.busy_ratio)

    def _generate(self, group: list[Slot]) -> None:
        """Run one model batch; on failure split it, so a job that breaks the model fails alone."""
        inputs = []
        for slot in group:
            assert slot.decoded is not None and slot.plan is not None and slot.job is not None
            inputs.append(GenerationInput(slot.decoded.tensor, slot.plan.text, slot.job.max_new_tokens))
        began = time.perf_counter()
        prepared_s = 0.0
        try:
            prepared = self.backend.prepare(inputs)
            prepared_s = time.perf_counter() - began
            outputs = self.backend.run(prepared)
            if len(outputs) != len(group):
                raise InternalError(f"model returned {len(outputs)} outputs for {len(group)} inputs")
        except Exception as exc:
            self._busy(time.perf_counter() - began - prepared_s)
            if len(group) > 1:
                self.log.warning("MRC_BATCH_SPLIT", jobs=len(group), error=repr(exc)[:300])
                first, second = batching.halves(range(len(group)))
                self._generate([group[i] for i in first])
                self._generate([group[i] for i in second])
                return
            group[0].error = exc if isinstance(exc, MrcError) else _model_error(exc)
            return
        run_s = time.perf_counter() - began - prepared_s
        self._busy(run_s)
        self.log.info("MRC_MODEL_BATCH", jobs=len(group), prepare_ms=round(prepared_s * 1000, 1),
                      run_ms=round(run_s * 1000, 1))  # fmt: skip
        for slot, output in zip(group, outputs, strict=True):
            slot.text = output.text
            slot.output_tokens = output.output_tokens
            slot.timings["preprocess"] += prepared_s * 1000
            slot.timings["inference"] = run_s * 1000

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


def _model_error(exc: Exception) -> MrcError:
    if "out of memory" in str(exc).lower():
        return OutOfMemory(str(exc)[:500])
    return ModelError(f"generation failed: {exc!r}"[:500])
