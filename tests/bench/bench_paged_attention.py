"""Why the CPU keeps contiguous slots: one layer's decode attention over 16 rows of 300-2,400 positions
(about 21,500 in all), Fuyu-8B's 64 heads of 64, one thread, three ways to keep the cache:

- contiguous slots (workers/engine/row_attention.py): each row's keys and values one run of a pool,
  read as a view, one SDPA call per row;
- pages, gathered: the pool cut in blocks of 16 positions handed out in any order (vLLM's layout);
  each row's blocks gathered into one tensor (`index_select`), then SDPA;
- pages, flex_attention: the same paged pool read in place by `torch.nn.attention.flex_attention`
  (compiled) with a mask that maps each query row to its own blocks (`--flex`: its compile takes
  a minute here).

    python tests/bench/bench_paged_attention.py [--repeats 30] [--flex]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

HEADS, DIM, BLOCK = 64, 64, 16


def _timed(call: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--flex", action="store_true", help="also time flex_attention (compiles)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(38)
    lengths = [rng.randrange(300, 2401) for _ in range(16)]
    total = sum(lengths)
    query = torch.randn(16, HEADS, 1, DIM)
    pool_k, pool_v = torch.randn(HEADS, total, DIM), torch.randn(HEADS, total, DIM)
    starts = [sum(lengths[:i]) for i in range(16)]

    def contiguous() -> None:
        for i, (start, length) in enumerate(zip(starts, lengths, strict=True)):
            F.scaled_dot_product_attention(
                query[i : i + 1],
                pool_k[None, :, start : start + length],
                pool_v[None, :, start : start + length],
            )

    blocks = [-(-n // BLOCK) for n in lengths]
    order = list(range(sum(blocks)))
    rng.shuffle(order)  # pages handed out in any order
    paged_k = torch.randn(HEADS, len(order) * BLOCK, DIM)
    paged_v = torch.randn(HEADS, len(order) * BLOCK, DIM)
    tables, cursor = [], 0
    for count in blocks:
        pages = torch.tensor(order[cursor : cursor + count])
        cursor += count
        tables.append((pages.unsqueeze(1) * BLOCK + torch.arange(BLOCK)).flatten())

    def gathered() -> None:
        for i, (table, length) in enumerate(zip(tables, lengths, strict=True)):
            index = table[:length]
            keys = paged_k.index_select(1, index)[None]
            values = paged_v.index_select(1, index)[None]
            F.scaled_dot_product_attention(query[i : i + 1], keys, values)

    figures = {"contiguous slots, SDPA per row": _timed(contiguous, args.repeats)}
    figures["pages gathered, then SDPA"] = _timed(gathered, args.repeats)
    if args.flex:
        figures["pages, flex_attention (compiled)"] = _flex(
            query, paged_k, paged_v, tables, lengths, args.repeats
        )
    print(f"16 rows, {total:,} positions, {HEADS} heads of {DIM}, one thread; median of {args.repeats}\n")
    print("| layout | ms per layer's decode attention | × contiguous |")
    print("|---|---|---|")
    base = figures["contiguous slots, SDPA per row"]
    for name, ms in figures.items():
        print(f"| {name} | {ms:.1f} | {ms / base:.2f} |")


def _flex(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: list[torch.Tensor],
    lengths: list[int], repeats: int,
) -> float:  # fmt: skip
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    owner = torch.full((keys.shape[1],), -1, dtype=torch.long)
    for row, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        owner[table[:length]] = row

    def mask(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return owner[kv] == q

    queries = query.permute(2, 1, 0, 3)  # [1, heads, 16 rows as 16 query positions, dim]
    padded = -(-queries.shape[2] // 128) * 128
    queries = F.pad(queries, (0, 0, 0, padded - queries.shape[2]))
    block_mask = create_block_mask(mask, None, None, padded, keys.shape[1], device="cpu")
    attend = torch.compile(flex_attention)
    return _timed(lambda: attend(queries, keys[None], values[None], block_mask=block_mask), repeats)


if __name__ == "__main__":
    main()
