"""Why no prefill is padded: SDPA's causal path against the same attention with an explicit mask.

A prefill alone (or of rows with one input length) needs no mask, and transformers then calls
`scaled_dot_product_attention(is_causal=True)`; a padded prefill must pass a mask, which takes a
slower kernel. This times the two on one attention shape (docs/design.md, "Attention paths"):

    .venv/bin/python tests/bench/bench_attention_paths.py [--rows 8] [--heads 4] [--positions 2358]
        [--dim 64] [--repeats 7]

Prints the median seconds of each path, interleaved in one run, and their ratio.

With `--chunk C`, one prompt's attention (the first of --rows) in chunks of C positions, each over its
positions so far, the way the engine prefills (docs/design.md, "Chunks"): with the causal mask made
per chunk (the engine before the fifteenth session) against without one
(workers/engine/row_attention.py `suffix_attention`: the CPU's flash kernel twice, merged), beside the
whole prompt's causal attention in one call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.engine import row_attention


def _median(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each call, interleaved, each first in turn."""
    runs: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for name in names:
        calls[name]()  # warm
    for index in range(repeats):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            began = time.perf_counter()
            calls[name]()
            runs[name].append(time.perf_counter() - began)
    return {name: statistics.median(times) for name, times in runs.items()}


def _chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, repeats: int) -> None:
    q, k, v = q[:1], k[:1], v[:1]
    length = q.shape[2]
    starts = range(0, length, chunk)

    def masked() -> None:
        for start in starts:
            stop = min(start + chunk, length)
            mask = row_attention.causal(start, stop, q.dtype, q.device)
            F.scaled_dot_product_attention(
                q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], attn_mask=mask
            )

    def direct() -> None:
        for start in starts:
            stop = min(start + chunk, length)
            row_attention.suffix_attention(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], start, None)

    times = _median(
        {"whole": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), "masked": masked,
         "direct": direct},
        repeats,
    )  # fmt: skip
    print(f"\none prompt of {length} in chunks of {chunk} ({len(starts)} calls), median of {repeats}")
    for name, label in (("whole", "whole, one causal call"), ("masked", "chunks with masks"),
                        ("direct", "chunks without a mask")):  # fmt: skip
        print(f"{label:<24} {times[name] * 1000:.1f} ms ({times[name] / times['whole']:.2f}x whole)")
    print(f"without / with masks     {times['direct'] / times['masked']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--positions", type=int, default=2358)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunk", type=int, help="also time one prompt prefilled in chunks of this size")
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = (args.rows, args.heads, args.positions, args.dim)
    q, k, v = (torch.randn(shape) for _ in range(3))
    # The mask a padded batch carries: causal, as booleans (True = attend), one per row.
    mask = torch.ones(args.positions, args.positions, dtype=torch.bool).tril()
    mask = mask.expand(args.rows, 1, args.positions, args.positions)
    runs: dict[str, list[float]] = {"causal": [], "masked": []}
    with torch.inference_mode():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)  # warm both paths
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        for _ in range(args.repeats):
            for name in runs:
                began = time.perf_counter()
                if name == "causal":
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
                else:
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                runs[name].append(time.perf_counter() - began)
    causal, masked = (statistics.median(runs[name]) for name in ("causal", "masked"))
    print(f"shape {shape}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"causal (is_causal=True)  {causal:.3f} s")
    print(f"masked (attn_mask)       {masked:.3f} s")
    print(f"masked / causal          {masked / causal:.2f}x")
    if args.chunk:
        with torch.inference_mode():
            _chunks(q, k, v, args.chunk, args.repeats)


if __name__ == "__main__":
    main()
