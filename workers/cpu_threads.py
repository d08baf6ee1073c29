"""How many OpenMP threads the model uses on the CPU, and how they wait for work.

Measured (tests/bench/bench_cpu_contention.py, docs/benchmarks.md): with torch's defaults (a thread
per core, threads that spin while they wait) one job on the tiny Fuyu took 117 ms alone and 459-577 ms
beside one or two busy processes on two cores: a parallel step waits for its slowest thread, and a
thread whose core another process holds keeps the others spinning. With one thread it took 122 ms alone
and 221 ms beside two busy processes (a fair share of two cores among three), and a second thread
never paid for itself on a model this small (its matrices are 64 wide: each op is microseconds).

So: a model under SMALL_MODEL_PARAMETERS runs on one thread (the tests, the demo, the tiny Fuyu); a
larger one on every core this process may use, with passive waiting (workers/__init__.py sets
OMP_WAIT_POLICY=PASSIVE unless the operator set it): its ops are long enough that waking a sleeping
thread costs nothing, and a descheduled thread no longer holds the others spinning. MRC_CPU_THREADS
overrides the count. The image decode threads always use one each (workers/images.py).
"""

from __future__ import annotations

import os
from typing import Any

SMALL_MODEL_PARAMETERS = 100_000_000


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def choose(requested: int, parameters: int, cores: int) -> int:
    """The thread count: `requested` when set (> 0), else by the model's size."""
    if requested > 0:
        return requested
    return 1 if parameters < SMALL_MODEL_PARAMETERS else cores


def apply(model: Any, requested: int) -> int:
    """Set torch's intra-op threads for a model about to run on the CPU; returns the count."""
    import torch

    parameters = sum(int(p.numel()) for p in model.parameters())
    threads = choose(requested, parameters, usable_cores())
    torch.set_num_threads(threads)
    return threads
