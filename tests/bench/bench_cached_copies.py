"""How many copies of a photo the prefix cache keeps, and what that does to later questions' hits,
with the rule that keeps one copy of a photo whose questions diverge after it (workers/engine/
slot_table.py, `_diverging_copy`) and without it, side by side in one run.

A question's own tokens start inside the block where the photo's positions end, so questions about
one photo usually diverge in that block: without the rule, each question that leaves keeps a slot
with the photo again. The workload, through the engine in-process (tiny Fuyu, fp32, CPU): wave 1
asks 4 questions about each of photos 0-3 at once, wave 2 the same of photos 4-7, wave 3 one new
question about each of the 8 photos, in a pool of `--pool` positions. Reported per mode: positions
the cache holds for retained prefixes after each wave, and in wave 3 the rows that hit and the
prompt positions computed. The answers must be the same in both modes.

    python tests/bench/bench_cached_copies.py [--pool 24576] [--rows 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after sys.path is set

from shared.settings import Settings  # noqa: E402 - after sys.path is set
from tests.bench.workloads import PHOTOS_03_2MP, QUESTIONS  # noqa: E402 - after sys.path is set
from workers.backends.base import GenerationInput  # noqa: E402 - after sys.path is set
from workers.backends.fuyu import FuyuBackend  # noqa: E402 - after sys.path is set
from workers.engine import scheduler  # noqa: E402 - after sys.path is set
from workers.engine.engine import Engine  # noqa: E402 - after sys.path is set
from workers.engine.sequence import Sequence  # noqa: E402 - after sys.path is set
from workers.engine.slot_table import SlotTable  # noqa: E402 - after sys.path is set

FOLLOW_UP = "Is the address on the label legible?"


def _photo(index: int) -> torch.Tensor:
    _kind, width, height = PHOTOS_03_2MP[index % len(PHOTOS_03_2MP)]
    return torch.randint(
        0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(index)
    )


def _wave(
    backend: FuyuBackend, engine: Engine, done: dict[str, Sequence], jobs: list[tuple[int, str]]
) -> list[str]:
    ids = []
    for photo, prompt in jobs:
        inputs = backend.prepare([GenerationInput(_photo(photo), prompt, 8)]).inputs
        row_id = f"{len(done) + len(ids)}"
        row = Sequence(row_id, inputs, int(inputs["input_ids"].shape[1]), 8, backend.eos_id, "backlog")
        row.identity = ("bench", photo)
        engine.submit(row)
        ids.append(row_id)
    while not engine.idle:
        engine.step()
    return ids


def _run(backend: FuyuBackend, one_copy: bool, pool: int, rows: int) -> dict[str, Any]:
    original = SlotTable._diverging_copy
    if not one_copy:
        SlotTable._diverging_copy = lambda self, row_id: None  # type: ignore[method-assign]
    try:
        runner = backend.step_model(rows, pool=pool)
        done: dict[str, Sequence] = {}
        engine = Engine(runner, scheduler.Limits(rows, 0), lambda row: done.__setitem__(row.row_id, row))
        cached = []
        for photos in (range(4), range(4, 8)):
            _wave(backend, engine, done, [(p, q) for p in photos for q in QUESTIONS])
            cached.append(runner.table.cached)
        last = _wave(backend, engine, done, [(p, FOLLOW_UP) for p in range(8)])
    finally:
        SlotTable._diverging_copy = original  # type: ignore[method-assign]
    follow_ups = [done[row_id] for row_id in last]
    return {
        "cached": cached,
        "hits": sum(1 for row in follow_ups if row.cached_tokens),
        "computed": sum(row.prompt_tokens - row.cached_tokens for row in follow_ups),
        "prompt": sum(row.prompt_tokens for row in follow_ups),
        "answers": [done[r].tokens for r in sorted(done, key=int)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=int, default=24576, help="cache positions (MRC_BATCH_TOKEN_BUDGET)")
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    backend = FuyuBackend(
        Settings(model="tiny", home=str(ROOT / ".cache" / "mrc"), quantization="fp32", device="cpu")
    )
    backend.load()
    sizes = [backend.row_inputs(GenerationInput(_photo(p), QUESTIONS[0], 8))[1] for p in range(4)]
    print(f"prompt positions of the four photo sizes with the first question: {sizes}; pool {args.pool}")
    runs = {one: _run(backend, one, args.pool, args.rows) for one in (False, True)}
    if runs[False]["answers"] != runs[True]["answers"]:
        raise SystemExit("the answers differ with and without the rule")
    print(
        "| photos' copies | cached after wave 1 | after wave 2 | wave 3 hits (of 8) "
        "| wave 3 positions computed |"
    )
    print("|---|---|---|---|---|")
    for one, r in runs.items():
        print(
            f"| {'one (the rule)' if one else 'one per question'} | {r['cached'][0]:,} | {r['cached'][1]:,} "
            f"| {r['hits']} | {r['computed']:,} of {r['prompt']:,} |"
        )


if __name__ == "__main__":
    main()
