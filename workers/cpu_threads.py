"""How many OpenMP threads a model call uses on the CPU.

Measured (tests/bench/bench_cpu_contention.py, docs/benchmarks.md): with torch's defaults (a thread
per core, threads that spin while they wait) one ticket on the tiny Fuyu took ~105 ms alone and
~715 ms beside two busy processes on two cores: a parallel step waits for its slowest thread, and a
thread whose core another process holds keeps its partner spinning. On one thread the same call took
~130 ms alone and ~185 ms beside two busy processes (a fair share), because a call this small (a few
hundred positions, 64-wide matrices) gains nothing from a second thread. A large call (a batch of 1 MP
photos: thousands of positions) is another matter: two threads make it ~1.5x faster alone. Sleeping
instead of spinning (OMP_WAIT_POLICY=PASSIVE) cost 2-3x on small calls and ~1.5x on large ones here.

So each call takes its thread count from its size: one thread below SMALL_CALL_POSITIONS prefill
positions (tickets, the tests, the demo: a CPU worker beside other processes keeps its speed), every
usable core above it (batches, where threads pay; beside busy processes those still slow down, see
docs/benchmarks.md). MRC_CPU_THREADS fixes the count instead. The image decode threads always use one
each (workers/images.py).
"""

from __future__ import annotations

import os

SMALL_CALL_POSITIONS = 4096  # prefill positions (rows x padded length) of a call that runs on one thread


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def choose(requested: int, positions: int, cores: int) -> int:
    """Threads for one model call of `positions` prefill positions: `requested` when set (> 0)."""
    if requested > 0:
        return requested
    return 1 if positions < SMALL_CALL_POSITIONS else cores


def apply(requested: int, positions: int) -> int:
    """Set torch's intra-op threads for the next model call on the CPU; returns the count."""
    import torch

    threads = choose(requested, positions, usable_cores())
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
