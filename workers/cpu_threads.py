"""How many OpenMP threads a model call uses on the CPU.

Measured (tests/bench/bench_cpu_contention.py, docs/benchmarks.md): with torch's defaults (a thread
per core, threads that spin while they wait) one ticket on the tiny Fuyu took ~105 ms alone and
~715 ms beside two busy processes on two cores: a parallel step waits for its slowest thread, and a
thread whose core another process holds keeps its partner spinning. On one thread the same call took
~130 ms alone and ~185 ms beside two busy processes (a fair share), because a call this small (a few
hundred positions, 64-wide matrices) gains nothing from a second thread. A large call (a batch of 1 MP
photos: thousands of positions) is another matter: two threads make it ~1.5x faster alone. Sleeping
instead of spinning (OMP_WAIT_POLICY=PASSIVE) cost 2-3x on small calls and ~1.5x on large ones here.

So each call takes its thread count from its size: one thread below a threshold, every usable core
above it (beside busy processes those still slow down, see docs/benchmarks.md). A prefill's threshold
is PREFILL_POSITIONS: an image's prefill (a 1 MP photo is ~1,300 positions) is a large matrix product
that a second core speeds up, while a ticket's text-sized call is not. A prefill call counts its rows'
whole prefills, less what each reused from the prefix cache (workers/engine/runner.py): a chunk gets
the threads its prompt whole would, and a question's few positions after its photo's prefix hit stay
on one thread; counted by the chunk's own positions, every chunk of 512 ran on one thread and a
2,400-position prompt cost 1.89-2.10x its whole prefill on two (tests/bench/bench_prefill.py, twelfth
session). A decode step's is DECODE_POSITIONS of positions read: one position per row is little work,
and below that threshold a step stays on one thread. MRC_CPU_THREADS fixes the count instead. The
image decode threads always use one each (workers/images.py).

A large call also leaves a core to each photo the worker is decoding beside it (`beside_model`): the
decode threads are the model's own pipeline, and a parallel step waits for its slowest thread. Measured
on photo-questions (bench_throughput.py, 12 photos x 4 questions, photos decoded while rows decode):
every step on one thread 30-33 jobs/s against 25-29 with two threads for the large steps, in three
pairs; the engine alone (bench_prefix_split.py, nothing beside it) is 1.25x faster on two threads,
which is what a step gets when no photo is being decoded.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_beside = 0  # photos being decoded now, in this process (beside_model)
_beside_lock = threading.Lock()


@contextmanager
def beside_model() -> Iterator[None]:
    """Marks CPU work the worker runs beside the model (a photo's decode): while it runs, a large
    model call leaves it a core."""
    global _beside
    with _beside_lock:
        _beside += 1
    try:
        yield
    finally:
        with _beside_lock:
            _beside -= 1


def running_beside() -> int:
    return _beside


PREFILL_POSITIONS = 1024  # prefill positions (rows x length) from which a prefill takes every core
DECODE_POSITIONS = 4096  # cache positions a decode step reads from which it takes every core


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def choose(requested: int, positions: int, cores: int, kind: str = "prefill", beside: int = 0) -> int:
    """Threads for one model call (`kind` prefill or decode) of `positions`, with `beside` decodes
    running in the process: `requested` when set."""
    if requested > 0:
        return requested
    threshold = PREFILL_POSITIONS if kind == "prefill" else DECODE_POSITIONS
    return 1 if positions < threshold else max(1, cores - beside)


def apply(requested: int, positions: int, kind: str = "prefill") -> int:
    """Set torch's intra-op threads for the next model call on the CPU; returns the count."""
    import torch

    threads = choose(requested, positions, usable_cores(), kind, running_beside())
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
