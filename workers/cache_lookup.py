"""The cache stage of a delivery: every live job's key, one round trip for all of them, and a hit made
into the job's answer (it skips decoding, preprocessing and the model; the job still gets its own
result). A cache that is down costs GPU time, never a job."""

from __future__ import annotations

from typing import Any

from shared.response_format import read_output
from shared.settings import Settings
from workers.backends.base import ModelBackend
from workers.cache import ResultCache, job_cache_key
from workers.metrics import Metrics
from workers.slots import Slot


def look_up(
    cache: ResultCache,
    backend: ModelBackend,
    settings: Settings,
    metrics: Metrics,
    log: Any,
    live: list[Slot],
) -> None:
    for slot in live:
        assert slot.job is not None
        assert slot.encoded is not None
        assert slot.plan is not None
        slot.cache_key = job_cache_key(
            backend, settings, slot.job.max_new_tokens, slot.encoded.sha256, slot.plan,
            slot.job.response_format, slot.job.api_key,
        )  # fmt: skip
    try:
        hits = cache.get_many([str(slot.cache_key) for slot in live])
    except Exception as exc:  # a cache that is down costs GPU time, never a job
        log.warning("MRC_CACHE_READ_FAILED", jobs=len(live), error=repr(exc)[:300])
        hits = [None] * len(live)
    for slot, hit in zip(live, hits, strict=True):
        hit = _usable_hit(slot, hit)
        metrics.cache.labels(result="hit" if hit else "miss").inc()
        if hit is not None:
            _answer_from(slot, hit)


def _answer_from(slot: Slot, hit: dict[str, Any]) -> None:
    assert slot.encoded is not None
    slot.encoded = slot.encoded.without_bytes()  # never decoded: the result needs its hash
    slot.text, slot.output_tokens, slot.cache_hit = str(hit["text"]), int(hit["output_tokens"]), True
    reason = hit.get("finish_reason")  # absent from entries cached before the engine
    positions = hit.get("prompt_tokens")  # absent from entries cached before usage
    slot.prompt_positions = positions if isinstance(positions, int) else None
    slot.finish_reason = reason if reason in ("stop", "length") else None


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
