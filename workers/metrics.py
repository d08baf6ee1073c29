"""Prometheus metrics of one worker. Names begin with mrc_."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from shared import redis_target

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900)
_JOBS_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def prompt_bucket(tokens: int) -> str:
    """The latency heatmap's prompt axis: 0-50, 50-100, 100+ tokens."""
    return "0-50" if tokens < 50 else "50-100" if tokens < 100 else "100+"


def image_bucket(width: int, height: int) -> str:
    """The latency heatmap's image axis: under 1 MP, 1-4 MP, over 4 MP."""
    pixels = width * height
    return "<1MP" if pixels < 1_000_000 else "1-4MP" if pixels <= 4_000_000 else ">4MP"


class Metrics:
    """One registry per worker process (a fresh one per test)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        r.register(redis_target.FailoverCollector())
        self.jobs = Counter(
            "mrc_jobs_total", "Jobs finished, by outcome", ["status", "code", "lane"], registry=r
        )
        self.latency = Histogram(
            "mrc_job_latency_seconds",
            "Submit-to-result time, by lane, prompt length (tokens) and image size (megapixels)",
            ["lane", "prompt_tokens", "image_mp"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.job_stage = Histogram(
            "mrc_job_stage_seconds",
            "Per-job time by stage: queued (submit to start), preprocess (fetch, decode, prepare), "
            "inference (its model batch), total",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.model_batch_jobs = Histogram(
            "mrc_model_batch_jobs", "Rows per engine decode step", buckets=_JOBS_BUCKETS, registry=r
        )
        self.model_batch_tokens = Histogram(
            "mrc_model_batch_tokens",
            "Cache positions per engine decode step (rows x the longest row, padding included)",
            buckets=(256, 1024, 4096, 8192, 16384, 32768, 65536, 131072),
            registry=r,
        )
        self.grammar_compile = Histogram(
            "mrc_grammar_compile_seconds",
            "Compile time of a structured answer's grammar (a cache miss), by format type",
            ["type"],
            buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10),
            registry=r,
        )
        self.grammar_cache = Counter(
            "mrc_grammar_cache_total",
            "Compiled-grammar look-ups, by result (hit, miss)",
            ["result"],
            registry=r,
        )
        self.buffered = Gauge(
            "mrc_worker_buffered_jobs",
            "Jobs the worker holds and has not started (celery-batches' buffer)",
            registry=r,
        )
        self.in_batch = Gauge(
            "mrc_batch_in_progress", "1 while a delivered batch is being processed", registry=r
        )
        self.in_batch_s = Gauge(
            "mrc_batch_in_progress_seconds",
            "How long the batch in hand has run (0 between batches)",
            registry=r,
        )
        ProcessCollector(
            namespace="mrc", registry=r
        )  # mrc_process_cpu_seconds_total, _resident_memory_bytes, ...
        self.batch_jobs = Histogram(
            "mrc_batch_jobs", "Jobs per delivered batch", buckets=_JOBS_BUCKETS, registry=r
        )
        self.stage = Histogram(
            "mrc_stage_seconds",
            "Wall time per pipeline stage and batch",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.model_busy = Counter(
            "mrc_model_busy_seconds_total", "Seconds the model was generating", registry=r
        )
        self.prompt_truncated = Counter(
            "mrc_prompts_truncated_total", "Prompts cut to the token limit", registry=r
        )
        self.padding = Histogram(
            "mrc_batch_padding_ratio",
            "Padding share of the running batch's cache at a decode step",
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75),
            registry=r,
        )
        self.busy_ratio = Gauge(
            "mrc_model_busy_ratio",
            "Share of wall time the model generated, since the first batch",
            registry=r,
        )
        self.retries = Counter(
            "mrc_retries_total", "Jobs put back for a retryable fault", ["code"], registry=r
        )
        for code in ("internal_error", "out_of_memory"):  # the retryable codes: series from 0, not absent
            self.retries.labels(code=code)
        self.dead_letters = Counter(
            "mrc_dead_letters_total", "Jobs moved to the dead-letter list", registry=r
        )
        # S3 away, seen by the jobs it stops: its retries count no attempt for MRC_STORE_OUTAGE_S, so no
        # job fails (and no failure alert fires) for that long; this is the outage's own signal.
        self.store_faults = Counter(
            "mrc_store_faults_total",
            "Jobs that met S3 away (their image not read or result not stored)",
            registry=r,
        )
        self.cache = Counter("mrc_cache_requests_total", "Result cache look-ups", ["result"], registry=r)
        self.ready = Gauge("mrc_worker_ready", "1 once the model is loaded and warmed up", registry=r)
        # Which lanes this worker takes (--lanes): the GPU-starved alert weighs only their depth, so a
        # backlog-only worker idle while tickets wait is not "starved".
        self.lanes = Gauge("mrc_worker_lanes", "1 for each lane this worker consumes", ["lane"], registry=r)
        self.duplicates = Counter("mrc_jobs_skipped_total", "Deliveries skipped as already done", registry=r)
        self._engine_metrics(r)

    def _engine_metrics(self, r: CollectorRegistry) -> None:
        """The iteration-level engine (workers/engine/): rates come from the counters."""
        self.rows_running = Gauge("mrc_engine_rows_running", "Rows in the running batch", registry=r)
        self.rows_waiting = Gauge(
            "mrc_engine_rows_waiting", "Rows waiting for admission, by lane", ["lane"], registry=r
        )
        self.rows_held = Gauge(
            "mrc_engine_rows_held", "Backlog rows in memory sitting out steps beside tickets", registry=r
        )
        self.backlog_stalled = Gauge(
            "mrc_engine_backlog_stalled_steps",
            "Engine steps in a row at which the backlog had work and none of its rows moved",
            registry=r,
        )
        self.kv_used = Gauge(
            "mrc_engine_kv_tokens_used", "Cache positions the rows in memory (running, held) hold", registry=r
        )
        self.kv_capacity = Gauge(
            "mrc_engine_kv_tokens_capacity",
            "Cache positions allocated (the pool the rows' slots share)",
            registry=r,
        )
        self.kv_reserved = Gauge(
            "mrc_engine_kv_tokens_reserved",
            "Cache positions the rows' slots span (each row's need; what admission counts)",
            registry=r,
        )
        self.slots_used = Gauge(
            "mrc_engine_slots_used", "Rows holding a slot (running, held, prefilling)", registry=r
        )
        self.slots = Gauge("mrc_engine_slots", "Rows in memory at most", registry=r)
        self.positions_read = Counter(
            "mrc_engine_positions_read_total", "Cache positions decode steps read (attention)", registry=r
        )
        self.positions_padding = Counter(
            "mrc_engine_positions_padding_total",
            "Of those, positions no row holds (a fixed-shape step's padding)",
            registry=r,
        )
        self.steps = Counter("mrc_engine_steps_total", "Engine steps that ran the model", registry=r)
        self.generated = Counter(
            "mrc_engine_generated_tokens_total",
            "Tokens of finished answers (end-of-text excluded)",
            registry=r,
        )
        self.discarded = Counter(
            "mrc_engine_discarded_tokens_total",
            "Tokens generated and thrown away: runs paused for a ticket or recomputed after a failed step",
            registry=r,
        )
        self.paused = Counter(
            "mrc_engine_paused_rows_total",
            "Rows sent back to waiting (paused for a ticket, or their step failed)",
            ["reason"],
            registry=r,
        )
        self.prefill_computed = Counter(
            "mrc_engine_prefill_positions_total",
            "Prompt positions prefilled (computed, in chunks)",
            registry=r,
        )
        self.prefill_calls = Counter(
            "mrc_engine_prefill_calls_total",
            "Prefill model calls: a step's chunks of every row go in one (a few when one photo's "
            "questions join together; a failed call of several is run again row by row)",
            registry=r,
        )
        self.prefix_lookups = Counter(
            "mrc_engine_prefix_lookups_total", "Rows admitted that could reuse a cached prefix", registry=r
        )
        self.prefix_hits = Counter(
            "mrc_engine_prefix_hits_total",
            "Of those, rows that reused one (hit ratio: hits / lookups)",
            registry=r,
        )
        self.prefix_reused = Counter(
            "mrc_engine_prefix_positions_reused_total",
            "Prompt positions reused from the cache, not computed",
            registry=r,
        )
        self.image_decodes = Counter(
            "mrc_image_decodes_total",
            "Images a job needed decoded: decoded, or reused from the decoded photos kept (a photo's "
            "next question)",
            ["result"],
            registry=r,
        )
        self.image_fetches = Counter(
            "mrc_image_fetches_total",
            "Images jobs needed: fetched from S3; shared, the fetch of the same URI another job of its key "
            "and lane was making; or kept, a decoded photo the job names by content (not fetched at all)",
            ["result"],
            registry=r,
        )
        self.decoded_images_held = Gauge(
            "mrc_decoded_images_held_bytes",
            "CPU memory held by the decoded photos kept for their next question (MRC_DECODED_IMAGE_CACHE_MB)",
            registry=r,
        )
        self.prefix_cached = Gauge(
            "mrc_engine_prefix_cached_positions",
            "Cache positions held by finished rows' prefixes (freed when a row needs the slot)",
            registry=r,
        )
        self.admission_wait = Histogram(
            "mrc_engine_admission_wait_seconds",
            "Handed to the engine -> admitted to the running batch, by lane",
            ["lane"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=r,
        )
        for lane in ("interactive", "backlog"):
            self.rows_waiting.labels(lane=lane)
            self.admission_wait.labels(lane=lane)
        for reason in ("ticket", "failed_step"):
            self.paused.labels(reason=reason)
        for result in ("decoded", "reused"):
            self.image_decodes.labels(result=result)
        for result in ("fetched", "shared", "kept"):
            self.image_fetches.labels(result=result)

    def watch(self, buffered: Callable[[], float], batch_for: Callable[[], float | None]) -> None:
        """Gauges read at scrape time from the live worker."""
        self.buffered.set_function(buffered)
        self.in_batch.set_function(lambda: 0.0 if batch_for() is None else 1.0)
        self.in_batch_s.set_function(lambda: batch_for() or 0.0)
