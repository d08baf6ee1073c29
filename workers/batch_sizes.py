"""How many jobs a model batch should hold, per input length: measured, not assumed.

Batching pays when one batch of b jobs costs less than b single jobs. On a GPU decode is bound by
memory bandwidth and a batch of 32 costs little more than one job; on two CPU cores a long prefill is
compute-bound and a batch of long inputs costs b times one (or more, with padding). So at warm-up the
worker times batches of 1, 2, 4, ... copies of a probe image for a few input-length buckets, and caps
each bucket where the per-job cost stops falling. Live model batches keep a running per-job cost per
(bucket, size) beside the measurement, for /readyz and `mrc queues`.

`MRC_MODEL_BATCH_MAX_JOBS` stays the upper bound; with `MRC_BATCH_CALIBRATE=0` every bucket takes it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.backends import fuyu_geometry

# Probe images (height, width): a small upload, a medium photo, and one that fills Fuyu's 1080x1920
# canvas (every 12 MP phone photo and full-HD screenshot lands there after resize-to-fit).
PROBES: tuple[tuple[int, int], ...] = ((240, 320), (768, 1024), (1080, 1920))
# Per-job cost within this fraction of the best counts as "no longer falling": noise on a busy machine
# must not buy a batch size that does not pay.
TOLERANCE = 0.05
CALIBRATION_STEPS = 16  # decode steps per probe batch: prefill and decode both weigh in
_LIVE_WEIGHT = 0.2  # exponential moving average of live per-job costs


def choose_cap(per_job_s: dict[int, float], upper: int, tolerance: float = TOLERANCE) -> int:
    """The smallest measured size whose per-job cost is within `tolerance` of the best one; the upper
    bound when the best is the largest size measured and that was not yet the bound (still falling)."""
    if not per_job_s:
        return upper
    best = min(per_job_s.values())
    chosen = min(size for size, cost in per_job_s.items() if cost <= best * (1 + tolerance))
    largest = max(per_job_s)
    if chosen == largest and largest < upper and per_job_s[largest] == best:
        return upper
    return chosen


@dataclass
class Bucket:
    probe: tuple[int, int]
    positions: int  # input positions of the probe (image + a short prompt)
    limit: int  # the longest input that belongs here (the last bucket takes everything longer)
    measured_s: dict[int, float] = field(default_factory=dict)  # size -> seconds per job at warm-up
    live_s: dict[int, float] = field(default_factory=dict)  # size -> running seconds per job
    cap: int = 1


class BatchSizes:
    """The per-bucket caps the batcher asks for; thread-safe (the heartbeat reads the table)."""

    def __init__(self, buckets: list[Bucket], upper: int, calibrated: bool) -> None:
        self.buckets = buckets
        self.upper = upper
        self.calibrated = calibrated
        self._lock = threading.Lock()

    @classmethod
    def fixed(cls, upper: int, max_side: int = 0) -> BatchSizes:
        """Not measured: every bucket may hold `upper` jobs."""
        buckets = _buckets(max_side)
        for bucket in buckets:
            bucket.cap = upper
        return cls(buckets, upper, calibrated=False)

    def bucket(self, input_tokens: int) -> Bucket:
        for bucket in self.buckets:
            if input_tokens <= bucket.limit:
                return bucket
        return self.buckets[-1]

    def cap(self, input_tokens: int) -> int:
        """The most jobs a model batch whose longest input is `input_tokens` should hold."""
        return min(self.upper, self.bucket(input_tokens).cap)

    def observe(self, input_tokens: int, jobs: int, seconds: float) -> None:
        """A live model batch: its longest input, its size and its wall time (prepare + run)."""
        if jobs < 1:
            return
        bucket = self.bucket(input_tokens)
        per_job = seconds / jobs
        with self._lock:
            old = bucket.live_s.get(jobs)
            bucket.live_s[jobs] = per_job if old is None else old + _LIVE_WEIGHT * (per_job - old)

    def table(self) -> list[dict[str, Any]]:
        """One row per bucket, for the start-up log, /readyz and `mrc queues`."""
        with self._lock:
            return [
                {
                    "max_input_tokens": None if i == len(self.buckets) - 1 else b.limit,
                    "probe_tokens": b.positions,
                    "cap": min(self.upper, b.cap),
                    "measured_ms_per_job": {
                        str(k): round(v * 1000, 2) for k, v in sorted(b.measured_s.items())
                    },
                    "live_ms_per_job": {str(k): round(v * 1000, 2) for k, v in sorted(b.live_s.items())},
                }
                for i, b in enumerate(self.buckets)
            ]

    def summary(self) -> str:
        """`<=96:8,<=910:4,>910:1`: bucket limits and caps in one log field."""
        parts = []
        for i, bucket in enumerate(self.buckets):
            last = i == len(self.buckets) - 1
            limit = f">{self.buckets[i - 1].limit}" if last and i else f"<={bucket.limit}"
            parts.append(f"{limit}:{min(self.upper, bucket.cap)}")
        return ",".join(parts)


def _buckets(max_side: int, prompt_tokens: int = 8) -> list[Bucket]:
    positions = sorted(
        {fuyu_geometry.image_token_count(h, w, max_side) + prompt_tokens: (h, w) for h, w in PROBES}.items()
    )
    buckets = []
    for i, (count, probe) in enumerate(positions):
        # The boundary between two probes is their geometric mean: a bucket holds inputs within a
        # factor of its probe's length, whichever side.
        limit = int(math.sqrt(count * positions[i + 1][0])) if i + 1 < len(positions) else count
        buckets.append(Bucket(probe=probe, positions=count, limit=limit))
    return buckets


def sizes_to_try(upper: int, positions: int, token_budget: int, steps: int) -> list[int]:
    """1, 2, 4, ... up to the bound and within the token budget (the bound itself included)."""
    sizes, size = [], 1
    while size < upper:
        sizes.append(size)
        size *= 2
    sizes.append(upper)
    return [s for s in sizes if s == 1 or (positions + steps) * s <= token_budget]


def calibrate(
    run_batch: Callable[[tuple[int, int], int, int], None],
    upper: int,
    token_budget: int,
    max_side: int = 0,
    steps: int = CALIBRATION_STEPS,
    repeats: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> BatchSizes:
    """Time `run_batch(probe, size, steps)` for each bucket and size (best of `repeats`, after one
    unmeasured run per bucket), and cap each bucket where the per-job cost stops falling."""
    buckets = _buckets(max_side)
    for bucket in buckets:
        run_batch(bucket.probe, 1, steps)  # first touch of this shape: allocations, kernel choice
        for size in sizes_to_try(upper, bucket.positions, token_budget, steps):
            best = math.inf
            for _ in range(repeats):
                began = clock()
                run_batch(bucket.probe, size, steps)
                best = min(best, clock() - began)
            bucket.measured_s[size] = best / size
            if size > 1 and bucket.measured_s[size] > 1.5 * min(bucket.measured_s.values()):
                break  # clearly worse and only getting slower: no need to time the larger sizes
        bucket.cap = choose_cap(bucket.measured_s, upper)
    return BatchSizes(buckets, upper, calibrated=True)


def probe_runner(backend: Any) -> Callable[[tuple[int, int], int, int], None]:
    """`run_batch` for a model backend: `size` copies of a mid-grey probe image and a short prompt."""
    from workers.backends.base import GenerationInput
    from workers.backends.fuyu import torch_full_image

    def run(probe: tuple[int, int], size: int, steps: int) -> None:
        item = GenerationInput(
            image=torch_full_image(*probe), prompt="What is shown here?", max_new_tokens=steps
        )
        backend.generate([item] * size)

    return run


def caps_for(sizes: BatchSizes) -> Callable[[Sequence[int]], int]:
    """The batcher's view: the cap for a group, from its longest input."""
    return lambda inputs: sizes.cap(max(inputs)) if inputs else sizes.upper
