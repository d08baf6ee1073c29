"""How many OpenMP threads a model call takes on the CPU (workers/cpu_threads.py): by its size, and
leaving a core to each photo the worker decodes beside it."""

from __future__ import annotations

import threading

import pytest

from workers import cpu_threads


def test_a_small_call_takes_one_thread_and_a_large_one_every_core() -> None:
    prefill, decode = cpu_threads.PREFILL_POSITIONS, cpu_threads.DECODE_POSITIONS
    assert cpu_threads.choose(0, prefill - 1, 4) == 1
    assert cpu_threads.choose(0, prefill, 4) == 4
    assert cpu_threads.choose(0, decode - 1, 4, "decode") == 1
    assert cpu_threads.choose(0, decode, 4, "decode") == 4
    assert cpu_threads.choose(3, 1, 4) == 3  # MRC_CPU_THREADS fixes it, beside anything
    assert cpu_threads.choose(3, 10**6, 4, "decode", beside=4) == 3


@pytest.mark.parametrize(("cores", "beside", "threads"), [(2, 0, 2), (2, 1, 1), (2, 5, 1), (8, 3, 5)])
def test_a_large_call_leaves_a_core_to_each_decode_beside_it(cores: int, beside: int, threads: int) -> None:
    assert cpu_threads.choose(0, 10**6, cores, "prefill", beside) == threads
    assert cpu_threads.choose(0, 10**6, cores, "decode", beside) == threads
    assert cpu_threads.choose(0, 1, cores, "decode", beside) == 1


def test_decodes_are_counted_while_they_run_and_not_after_even_when_they_fail() -> None:
    started, release = threading.Barrier(3), threading.Event()
    before = cpu_threads.running_beside()

    def decode(fail: bool) -> None:
        try:
            with cpu_threads.beside_model():
                started.wait()
                release.wait()
                if fail:
                    raise ValueError("a corrupt photo")
        except ValueError:
            pass

    threads = [threading.Thread(target=decode, args=(fail,)) for fail in (False, True)]
    for thread in threads:
        thread.start()
    started.wait()
    assert cpu_threads.running_beside() == before + 2
    release.set()
    for thread in threads:
        thread.join()
    assert cpu_threads.running_beside() == before
