"""Memory held by need: how many rows one cache budget holds at once, slots of the longest job against
slots of each row's need (workers/engine/slot_table.py), for three mixes; and by need with the pool
step's slots, which start at multiples of its attention kernel's block (512 positions on the CPU).

The budget is what the worker's defaults gave 8 slots before (8 x the longest job allowed: the
largest image, MRC_MAX_PROMPT_TOKENS and MRC_MAX_NEW_TOKENS_LIMIT), shown also in GiB at Fuyu-8B's
shape in bf16. For each mix the real engine (the tiny Fuyu, the worker's preprocessing and
positions) is given more waiting jobs than the pool can hold, a row limit that never binds, and that
pool; after one step the rows in memory are counted (admitted by positions; a row holds its slot
from admission). The uniform grid (the fixed-shape step's layout, and every row's slot before) holds
budget / longest rows whatever the mix. Then every row admitted runs to its end, so the count is of
rows that really ran together, not of a plan.

    python tests/bench/bench_memory.py [--slots 8]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after sys.path is set

from shared.settings import Settings  # noqa: E402 - after sys.path is set
from workers.backends.base import GenerationInput  # noqa: E402 - after sys.path is set
from workers.backends.fuyu import FuyuBackend  # noqa: E402 - after sys.path is set
from workers.engine import capacity, scheduler  # noqa: E402 - after sys.path is set
from workers.engine.engine import Engine  # noqa: E402 - after sys.path is set
from workers.engine.sequence import Sequence  # noqa: E402 - after sys.path is set
from workers.engine.slot_table import rounded  # noqa: E402 - after sys.path is set

# Fuyu-8B: 36 layers, 64 heads of 64, keys and values in bf16.
FUYU_8B_BYTES_PER_POSITION = 2 * 36 * 64 * 64 * 2
PROMPT = "Is the parcel in this photo damaged, and can the customer get a refund for it?"

# name -> a job's (width, height, new tokens), drawn
MIXES: dict[str, Any] = {
    "640x480 + 64 new tokens (tickets)": lambda rng: (640, 480, 64),
    "mixed 0.3-2 MP, 16 or 64 new tokens": lambda rng: (
        *rng.choice([(640, 480), (1024, 768), (1280, 960), (1600, 1200)]),
        rng.choice([16, 64]),
    ),
    "12 MP phone photos + 256 new tokens (backlog)": lambda rng: (4032, 3024, 256),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=8, help="the budget, in slots of the longest job")
    args = parser.parse_args()
    torch.manual_seed(0)
    backend = FuyuBackend(
        Settings(model="tiny", home=str(ROOT / ".cache" / "mrc"), quantization="fp32", device="cpu")
    )
    backend.load()
    longest = backend.slot_positions()
    budget = args.slots * (longest + 1)
    uniform_rows, _ = capacity.choose(budget, 1 << 20, 1 << 40, longest, uniform=True)
    gib = budget * FUYU_8B_BYTES_PER_POSITION / 2**30
    print(
        f"budget: {budget:,} positions = {args.slots} slots of the longest job ({longest:,} positions + 1) "
        f"= {gib:.1f} GiB at Fuyu-8B bf16; uniform slots hold {uniform_rows} rows whatever the mix\n"
    )
    header = ["mix", "positions a row needs (p50 / max)", "rows at once, slots of the longest job"]
    header += ["rows at once, by need", "ratio", "pool used by need"]
    header += [f"rows at once, pool step (slots on {capacity.slot_grain('pool', 'cpu')})", "ratio"]
    print("| " + " | ".join(header) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for name, draw in MIXES.items():
        rng = random.Random(7)
        rows: list[Sequence] = []
        while sum(rounded(r.need) for r in rows) < budget * 1.25:  # more than the pool holds
            rows.append(_row(backend, f"j{len(rows)}", *draw(rng)))
        held, used = _at_once(backend, rows, longest, budget, "rows")
        pooled, _ = _at_once(backend, [_again(row) for row in rows], longest, budget, "pool")
        needs = sorted(rounded(r.need) for r in rows)
        print(
            f"| {name} | {needs[len(needs) // 2]:,} / {needs[-1]:,} | {uniform_rows} | {held} | "
            f"**{held / uniform_rows:.1f}x** | {used / budget:.0%} | {pooled} | "
            f"{pooled / uniform_rows:.1f}x |",
            flush=True,
        )


def _row(backend: FuyuBackend, row_id: str, width: int, height: int, new: int) -> Sequence:
    image = torch.randint(0, 256, (3, height, width), dtype=torch.uint8)
    inputs, positions = backend.row_inputs(GenerationInput(backend.fit_image(image), PROMPT, new))
    return Sequence(row_id, inputs, positions, new, backend.eos_id, "backlog", exact_steps=True)


def _again(row: Sequence) -> Sequence:
    """The same job, not yet run."""
    return Sequence(
        row.row_id, row.inputs, row.prompt_tokens, row.max_new_tokens, row.eos_id, row.lane, exact_steps=True
    )


def _at_once(
    backend: FuyuBackend, rows: list[Sequence], longest: int, budget: int, decode: str
) -> tuple[int, int]:
    """(rows in memory after the first step, positions their slots span); those rows then run on to
    their last token together, decoded by `decode`'s step (the pool step's slots start at multiples of
    its kernel's block: workers/engine/pool_step.py)."""
    runner = backend.step_model(len(rows), longest, budget, decode=decode)
    finished: list[Sequence] = []
    engine = Engine(runner, scheduler.Limits(max_rows=len(rows), reserved_interactive=0), finished.append)
    for row in rows:
        engine.submit(row)
    engine.step()
    held, used = engine.in_memory, runner.table.reserved
    admitted = set(engine.running) | set(engine.prefilling)
    engine.waiting.clear()  # only the rows admitted together run on
    while not engine.idle:
        engine.step()
    assert {row.row_id for row in finished} == admitted
    assert all(row.error is None and len(row.tokens) == row.max_new_tokens for row in finished)
    return held, used


if __name__ == "__main__":
    main()
