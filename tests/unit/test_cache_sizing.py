"""The cache's sizing (workers/engine/capacity.py) against what the cache really allocates
(workers/engine/kv.py): the pool, and beside it the staging buffer (by need) and the pool step's
scratch position, all within the memory measured; and no more than one longest row of it left
unused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engine_runs import tiny_backend
from workers.backends.fuyu import FuyuBackend
from workers.engine import capacity

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")


@pytest.fixture(scope="module")
def backend() -> FuyuBackend:
    return tiny_backend(HOME)


@pytest.mark.parametrize("rows", [3, 7])
@pytest.mark.parametrize("decode", ["rows", "fixed", "pool"])
def test_the_cache_allocates_no_more_than_the_memory_it_was_sized_for(
    backend: FuyuBackend, decode: str, rows: int
) -> None:
    config, dtype = backend.model.config, backend.model.get_input_embeddings().weight.dtype
    positions = backend.slot_positions()
    per_position = capacity.bytes_per_token(config, dtype)
    memory = rows * (positions + 1) * per_position + 12_345  # what memory_for_cache found
    fit = capacity.positions_held(
        memory - capacity.beside_the_pool(config, dtype, positions, decode), per_position
    )
    slots, pool = capacity.choose(
        fit, 64, 1 << 40, positions, decode == "fixed", capacity.slot_grain(decode, "cpu")
    )
    runner = backend.step_model(slots, positions, pool, decode=decode)
    assert runner.cache.nbytes <= memory
    assert runner.cache.nbytes > memory - (positions + 1) * per_position
