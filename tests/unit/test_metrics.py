"""Metric helpers: the latency heatmap's buckets, and GPU series that are absent without a GPU."""

from __future__ import annotations

import pytest

from workers.gpu_metrics import GpuCollector
from workers.metrics import Metrics, image_bucket, prompt_bucket


@pytest.mark.parametrize(
    ("tokens", "bucket"), [(0, "0-50"), (49, "0-50"), (50, "50-100"), (99, "50-100"), (100, "100+")]
)
def test_prompt_buckets(tokens: int, bucket: str) -> None:
    assert prompt_bucket(tokens) == bucket


@pytest.mark.parametrize(
    ("size", "bucket"),
    [((640, 480), "<1MP"), ((1024, 1024), "1-4MP"), ((2000, 2000), "1-4MP"), ((4032, 3024), ">4MP")],
)
def test_image_buckets(size: tuple[int, int], bucket: str) -> None:
    assert image_bucket(*size) == bucket


def test_gpu_series_are_absent_on_the_cpu() -> None:
    assert list(GpuCollector("cpu").collect()) == []


def test_live_gauges_read_the_worker_at_scrape_time() -> None:
    metrics = Metrics()
    state = {"buffered": 3, "batch": None}
    metrics.watch(lambda: state["buffered"], lambda: state["batch"])  # type: ignore[arg-type, return-value]
    value = metrics.registry.get_sample_value
    assert (value("mrc_worker_buffered_jobs"), value("mrc_batch_in_progress")) == (3, 0)
    state["batch"] = 12.5
    assert (value("mrc_batch_in_progress"), value("mrc_batch_in_progress_seconds")) == (1, 12.5)


def test_the_queue_view_renders_as_lines_and_as_tables() -> None:
    from producer.ops import queues as queues_view

    view = {
        "lanes": {"interactive": 3, "backlog": 900},
        "in_flight": {"interactive": 1, "backlog": 16},
        "oldest_age_s": {"interactive": 0.4, "backlog": 812.0},
        "done_per_min": {"interactive": 12.0, "backlog": 540.2},
        "rejected": 0,
        "backlog_limit": 10000,
        "backlog_held_by_key": {"-": 880, "a1a1a1a1a1a1": 36},
        "backlog_share_each": 5000,
        "dead_letter": 2,
        "workers": [{"hostname": "mrc@gpu-1", "lanes": ["interactive", "backlog"], "model": "fuyu-8b",
                     "quantization": "nf4", "device": "cuda", "jobs": 41, "busy_ratio": 0.93, "buffered": 14,
                     "batch_in_progress_s": 2.5, "batch_caps": "<=313:32",
                     "attention_backend": "sdpa:flash"}],
        "cache": {"hits": 5, "misses": 15, "hit_rate": 0.25},
        "redis": {"redis_sentinel": True, "redis_master": "10.0.0.7:6379", "redis_sentinel_master": "mrc",
                  "redis_failovers": 2},
    }  # fmt: skip
    text = queues_view.render_text(view)
    assert "backlog      900  in flight 16, oldest waiting 812.0 s, done 540.2/min" in text
    assert "buffered 14, batch in progress 2.5 s" in text
    # Both views say what the docs promise (review: no limit in the lines; no master, no device in the
    # tables)
    master = "master 10.0.0.7:6379 (Sentinel 'mrc', 2 failovers seen)"
    assert "limit        backlog 10000" in text
    assert "held         backlog key -: 880, key a1a1a1a1a1a1: 36 (shared: 5000 each)" in text  # its shares
    assert master in text
    assert "nf4 on cuda" in text
    import io

    from rich.console import Console

    out = io.StringIO()
    queues_view.render_rich(view, Console(file=out, width=220))
    shown = out.getvalue()
    assert "mrc@gpu-1" in shown
    assert "540.2" in shown
    assert master in shown
    assert "backlog limit 10000" in shown
    assert "backlog held by key -: 880, key a1a1a1a1a1a1: 36 (shared: 5000 each)" in shown
    assert "│ cuda " in shown
