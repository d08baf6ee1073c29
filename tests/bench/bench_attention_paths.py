"""Why no prefill is padded: SDPA's causal path against the same attention with an explicit mask.

A prefill alone (or of rows with one input length) needs no mask, and transformers then calls
`scaled_dot_product_attention(is_causal=True)`; a padded prefill must pass a mask, which takes a
slower kernel. This times the two on one attention shape (docs/design.md, "Attention paths"):

    .venv/bin/python tests/bench/bench_attention_paths.py [--rows 8] [--heads 4] [--positions 2358]
        [--dim 64] [--repeats 7]

Prints the median seconds of each path, interleaved in one run, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--positions", type=int, default=2358)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
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


if __name__ == "__main__":
    main()
