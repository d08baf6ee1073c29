"""Prometheus metrics of one worker. Names begin with mrc_."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900)


class Metrics:
    """One registry per worker process (a fresh one per test)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.jobs = Counter(
            "mrc_jobs_total", "Jobs finished, by outcome", ["status", "code", "lane"], registry=r
        )
        self.latency = Histogram(
            "mrc_job_latency_seconds", "Submit-to-result time", ["lane"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.batch_jobs = Histogram(
            "mrc_batch_jobs", "Jobs per delivered batch", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
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
            "Padding share of a model batch",
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
        self.dead_letters = Counter(
            "mrc_dead_letters_total", "Jobs moved to the dead-letter list", registry=r
        )
        self.cache = Counter("mrc_cache_requests_total", "Result cache look-ups", ["result"], registry=r)
        self.ready = Gauge("mrc_worker_ready", "1 once the model is loaded and warmed up", registry=r)
        self.duplicates = Counter("mrc_jobs_skipped_total", "Deliveries skipped as already done", registry=r)
