"""What a prefill costs the engine, by how its positions are cut into model calls (issue 38). Two tables,
each way timed side by side in one run on one model (the GPU proving ground runs it as it is):

1. One prompt of P positions (--positions): whole (one call), in chunks of C positions written in place
   (each C of --chunks; MRC_ENGINE_PREFILL_TOKENS is 512: a ticket waits for one chunk, not a whole
   12 MP photo), and as a prefix hit (the same image and prompt held by a retained slot: only the last
   block's positions computed, <= 16). Goal: chunks cost <= 10 % more than one call. Each chunk size
   is timed twice: the engine's way and with the causal mask (`masked`). On CUDA the engine's way is
   SDPA's causal kernels without a mask (row_attention.suffix_attention, since the fifteenth session);
   on the CPU it is the mask too (row_attention's docstring says why), so the two columns agree.
2. A step's chunks of several rows: N questions (--rows) about one photo of P positions, each with T
   positions of its own left once its prefix hit is copied (--tail: the question, and the photo's last
   part-block), computed one call a row (the engine before the twelfth session) against one call for
   them all (workers/engine/runner.py `extend`, row_attention.per_chunk: the rows end to end, the model's
   layers run once, attention each row's own). The second's share of the first is what the engine
   saves on a step where rows join; on a GPU a call costs its launches (the host's time) more than its
   few positions.

    .venv/bin/python tests/bench/bench_prefill.py [--model random-256x4] [--positions 300,1300,2400]
        [--chunks 512] [--rows 4,16] [--tail 24] [--repeats 5] [--json F]
    python tests/bench/bench_prefill.py --device cuda --chunks 512,1024,2048 --json F   # fuyu-8b-shape
    .venv/bin/python tests/bench/bench_prefill.py --quick                            # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.bench_step_cost import load_model  # noqa: E402 - after sys.path is set
from workers.engine.runner import Runner  # noqa: E402 - after sys.path is set

MASKED = "sdpa_with_masks"  # SDPA under another name: row_attention.per_chunk makes it masks, as before


def _register_masked() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(MASKED, sdpa_attention_forward)


def _language_config(model: Any) -> Any:
    return model.model.language_model.config if hasattr(model, "model") else model.language_model.config


def _ids(model: Any, count: int) -> torch.Tensor:
    return torch.randint(3, int(model.config.text_config.vocab_size), (1, count), device=model.device)


def _stops(length: int, chunk: int) -> list[int]:
    return [min(stop, length) for stop in range(chunk, length + chunk, chunk)]


@torch.inference_mode()
def time_prefill(
    model: Any, threads: Any, length: int, chunks: list[int], repeats: int, sync: Any
) -> dict[str, Any]:
    """Median ms of a text prefill of `length` positions: whole, in chunks of each size, a prefix hit."""
    inputs = {"input_ids": _ids(model, length)}
    ways = [f"{kind}_{c}" for c in chunks for kind in ("chunks", "masked")]
    times: dict[str, list[float]] = {"whole": [], "hit": [], **{way: [] for way in ways}}
    config = _language_config(model)
    for index in range(repeats + 1):  # the first round warms each path
        runner = Runner(model, 2, length + 8, threads, "rows")
        sync()
        began = time.perf_counter()
        runner.prefill([inputs])
        sync()
        times["whole"].append(time.perf_counter() - began)
        for way in ways if index % 2 else ways[::-1]:  # each way first in every other round
            kind, chunk = way.split("_")
            before, config._attn_implementation = (
                config._attn_implementation,
                MASKED if kind == "masked" else "sdpa",
            )
            try:
                began = time.perf_counter()
                runner.begin("a", inputs, length, identity=("bench", index, way))
                for stop in _stops(length, int(chunk)):
                    runner.extend([("a", stop)])
                sync()
                times[way].append(time.perf_counter() - began)
            finally:
                config._attn_implementation = before
            runner.table.release("a")
        runner.begin("a", inputs, length, identity=("bench", index))
        runner.extend([("a", length)])
        runner.table.retain("a")  # finished: its slot kept for the prefix cache
        began = time.perf_counter()
        reused = runner.begin("b", inputs, length, identity=("bench", index))
        runner.extend([("b", length)])
        sync()
        times["hit"].append(time.perf_counter() - began)
        assert reused >= length - runner.table.index.block, reused  # whole blocks of 16 positions
    return {"positions": length, **{k: statistics.median(t[1:]) * 1000 for k, t in times.items()}}


@torch.inference_mode()
def time_calls(
    model: Any, threads: Any, prefix: int, rows: int, tail: int, repeats: int, sync: Any
) -> dict[str, Any]:
    """Median ms of `rows` questions' own positions (`tail` each) after their photo's prefix hit: one
    call a row against one call for all."""
    shared = _ids(model, prefix)
    inputs = [{"input_ids": torch.cat([shared, _ids(model, tail)], dim=1)} for _ in range(rows)]
    length = prefix + tail
    times: dict[str, list[float]] = {"each": [], "together": []}
    for index in range(repeats + 1):
        runner = Runner(model, rows + 1, length + 8, threads, "rows")
        identity = ("bench", index)
        runner.begin("photo", inputs[0], length, identity=identity)
        for stop in _stops(length, 512):
            runner.extend([("photo", stop)])
        runner.table.retain("photo")  # the photo's first question, finished: its prefix stays
        for way, calls in times.items():
            ids = [f"{way}{i}" for i in range(rows)]
            left = [length - runner.begin(r, inputs[i], length, identity) for i, r in enumerate(ids)]
            assert max(left) <= tail + runner.table.index.block, left
            sync()
            began = time.perf_counter()
            if way == "each":
                for row_id in ids:
                    runner.extend([(row_id, length)])
            else:
                runner.extend([(row_id, length) for row_id in ids])
            sync()
            calls.append(time.perf_counter() - began)
            runner.table.retain(ids[0])  # the prefix stays for the next way; the other rows leave
            for row_id in ids[1:]:
                runner.table.release(row_id)
    ms = {k: statistics.median(t[1:]) * 1000 for k, t in times.items()}
    return {"prefix": prefix, "rows": rows, "tail": tail, **ms}


def _table_prefill(results: list[dict[str, Any]], chunks: list[int]) -> None:
    heads = " | ".join(f"chunks of {c} ms (calls) | / whole | masked ms | / whole" for c in chunks)
    print(f"\n| prefill positions | whole ms | {heads} | prefix hit ms | hit / whole |")
    print("|---" * (4 + 4 * len(chunks)) + "|")
    for r in results:
        cells = " | ".join(
            f"{r[f'chunks_{c}']:.1f} ({len(_stops(r['positions'], c))}) | "
            f"{r[f'chunks_{c}'] / r['whole']:.2f} | "
            f"{r[f'masked_{c}']:.1f} | {r[f'masked_{c}'] / r['whole']:.2f}"
            for c in chunks
        )
        hit = f"{r['hit']:.1f} | {r['hit'] / r['whole']:.3f}"
        print(f"| {r['positions']} | {r['whole']:.1f} | {cells} | {hit} |")


def _table_calls(results: list[dict[str, Any]]) -> None:
    print("\n| photo positions | rows x own positions | one call a row ms | one call for all ms | all / each "
          "|")  # fmt: skip
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['prefix']} | {r['rows']} x {r['tail']} | {r['each']:.1f} | {r['together']:.1f} | "
              f"{r['together'] / r['each']:.2f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", help="tiny | random-HIDDENxLAYERS | fuyu-8b-shape (default on CUDA)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], help="default: fp32 on cpu, else bf16")
    parser.add_argument("--positions", default="300,1300,2400")
    parser.add_argument("--chunks", default="512")
    parser.add_argument("--rows", default="4,16")
    parser.add_argument("--tail", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.positions, args.chunks, args.rows, args.repeats = "64,200", "64", "4", 2
    cuda = args.device.startswith("cuda")
    model_name = args.model or ("fuyu-8b-shape" if cuda else "tiny")
    dtype = torch.bfloat16 if (args.dtype or ("bf16" if cuda else "fp32")) == "bf16" else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, threads = load_model(model_name, args.device, dtype)
    _register_masked()
    chunks = [int(c) for c in args.chunks.split(",")]
    positions = [int(p) for p in args.positions.split(",")]
    figures: dict[str, Any] = {"model": model_name, "device": args.device, "prefill": [], "calls": []}
    # Under a step limit (the GPU proving ground's GPU_STEP_LIMIT_S): no new measurement past 80 % of
    # it, and the figures so far are written after each, so a run cut short still reports.
    limit, began = float(os.environ.get("GPU_STEP_LIMIT_S", "0") or 0), time.monotonic()
    work = [("calls", p, r) for p in positions for r in (int(r) for r in args.rows.split(","))]
    for kind, length, rows in [*work, *(("prefill", p, 0) for p in positions)]:
        if limit and time.monotonic() - began > 0.8 * limit:
            print(f"  (stopped: {limit:g} s step limit; measurements left out)", flush=True)
            break
        try:
            if kind == "calls":
                result = time_calls(model, threads, length, rows, args.tail, args.repeats, sync)
            else:
                result = time_prefill(model, threads, length, chunks, args.repeats, sync)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            continue
        figures[kind].append(result)
        print(json.dumps(result), flush=True)
        if args.json:
            args.json.write_text(json.dumps(figures))
    _table_calls(figures["calls"])
    _table_prefill(figures["prefill"], chunks)
    print(f"({model_name}, {dtype}, {args.device}, median of {args.repeats})")


if __name__ == "__main__":
    main()
