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
