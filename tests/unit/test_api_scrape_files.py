"""mrc-api's /metrics with several processes (MRC_API_WORKERS > 1): every process's counters live in
a file of one folder, summed at each scrape (producer/http/state.py)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from producer.http.state import SizedFilesCollector


def test_a_file_a_process_has_made_but_not_yet_sized_leaves_the_scrape_whole(tmp_path: Path) -> None:
    """A CI run (MRC_API_WORKERS=2, a busy machine): a scrape met the other process's file as it was
    made, 0 bytes long, and answered 500 (prometheus/client_python#1199). A process killed at that
    moment leaves the file so for good."""
    written = MmapedDict(str(tmp_path / "counter_101.db"))
    key = mmap_key("mrc_api_requests", "mrc_api_requests_total", ["route"], ["/readyz"], "Requests")
    written.write_value(key, 8.0, 0.0)
    written.close()
    (tmp_path / "counter_102.db").touch()  # made, not yet sized
    (tmp_path / "histogram_102.db").write_bytes(b"\0\0")  # shorter than the header
    registry = CollectorRegistry()
    SizedFilesCollector(registry, path=str(tmp_path))
    scraped = generate_latest(registry).decode()
    assert 'mrc_api_requests_total{route="/readyz"} 8.0' in scraped
