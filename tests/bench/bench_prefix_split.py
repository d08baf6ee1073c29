"""What prefix reuse can buy at most: the engine alone over the photo-questions workload, its time split
into prefill (chunks), decode steps and admission, with the prefix cache on and off, side by side.

The workload is bench_throughput's `photo-questions` (12 photos of four sizes, 0.3-2 MP, 4 questions
each, shuffled with its seed, 16 new tokens, 8 rows), given to the engine as prepared inputs: no
queue, no S3, no JPEG decode. With reuse off, the share of the engine's time spent per prompt
position (the prefill, and admission: its image patches' projection is most of it) bounds what any
prefix cache can give (Amdahl): skipping a share `r` of the prompt positions in a time whose share
per position is `p` makes it at most 1 / (1 - p r) faster. The run prints that bound beside the
speed-up measured, for each pair of runs (on, off, alternated; the order flips in the second pair).

With `--model random-HIDDENxLAYERS` the engine runs a wider or deeper Fuyu of random weights (the tiny
Fuyu's tokenizer and image processor, heads of 64; tests/bench/random_fuyu.py) instead of the tiny
Fuyu the worker loads: the same jobs, with a prefill that is more of the time, as Fuyu-8B's is.

    python tests/bench/bench_prefix_split.py [--pairs 2] [--quantization nf4] [--model random-512x8]
        [--workload mixed-sizes-64] [--prefill-tokens 512]

`--workload` takes another of bench_throughput's rows; `--prefill-tokens`, a step's budget of prefill
positions (by default a row's prefill is whole, as photo-questions' rows come in waves; the worker's
on the CPU is 512). In half precision a split prefill can turn a near tie (docs/design.md): answers
that differ with reuse on and off are counted, not fatal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after sys.path is set

from shared.settings import Settings  # noqa: E402 - after sys.path is set
from tests.bench.workloads import WORKLOADS  # noqa: E402 - after sys.path is set
from workers.backends.base import GenerationInput  # noqa: E402 - after sys.path is set
from workers.backends.fuyu import FuyuBackend  # noqa: E402 - after sys.path is set
from workers.engine import scheduler  # noqa: E402 - after sys.path is set
from workers.engine.engine import Engine  # noqa: E402 - after sys.path is set
from workers.engine.sequence import Sequence  # noqa: E402 - after sys.path is set

PARTS = ("extend", "decode", "begin")  # the runner's calls: prefill chunks, decode steps, admission


def _jobs(backend: FuyuBackend, count: int, name: str = "photo-questions") -> list[Sequence]:
    """The workload's jobs in its order, each with its photo's identity (what the worker gives)."""
    workload = WORKLOADS[name]
    photos: dict[int, torch.Tensor] = {}
    rows = []
    for i in range(count):
        photo, prompt, new = workload.job(i)
        if photo not in photos:
            _kind, width, height = workload.images[photo % len(workload.images)]
            noise = torch.Generator().manual_seed(photo)
            photos[photo] = torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=noise)
        inputs = backend.prepare([GenerationInput(photos[photo], prompt, new)]).inputs
        row = Sequence(str(i), inputs, int(inputs["input_ids"].shape[1]), new, backend.eos_id, "backlog")
        row.identity = ("bench", photo)
        rows.append(row)
    return rows


def _random_source(model: str) -> Any:
    """A Fuyu of random weights in bf16, the tiny Fuyu's kind, `random-HIDDENxLAYERS` wide and deep."""
    from tests.bench import random_fuyu

    hidden, layers = (int(part) for part in model.removeprefix("random-").split("x"))
    config = random_fuyu.config_of("tiny")
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = hidden, 4 * hidden, layers
    text.num_attention_heads = max(1, hidden // 64)
    return random_fuyu.build(config, "cpu", torch.bfloat16)


def _backend(reuse: bool, quantization: Any, source: Any) -> FuyuBackend:
    settings = dict(quantization=quantization, device="cpu", engine_prefix_cache="on" if reuse else "off")
    if source is not None:
        from tests.bench import random_fuyu

        return random_fuyu.backend(
            source, quantization, "cpu", engine_prefix_cache=settings["engine_prefix_cache"]
        )
    backend = FuyuBackend(Settings(model="tiny", home=str(ROOT / ".cache" / "mrc"), **settings))
    backend.load()
    return backend


def _run(
    reuse: bool, quantization: Any, count: int, rows: int, source: Any = None,
    workload: str = "photo-questions", chunk: int = 1 << 30,
) -> dict[str, Any]:  # fmt: skip
    backend = _backend(reuse, quantization, source)
    runner = backend.step_model(rows)
    spent = dict.fromkeys(PARTS, 0.0)
    for part in PARTS:
        call = getattr(runner, part)

        def timed(*args: Any, _call: Any = call, _part: str = part, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return _call(*args, **kwargs)
            finally:
                spent[_part] += time.perf_counter() - began

        setattr(runner, part, timed)
    done: dict[str, Sequence] = {}
    limits = scheduler.Limits(rows, 0, prefill_tokens=chunk)
    engine = Engine(runner, limits, lambda row: done.__setitem__(row.row_id, row))
    jobs = _jobs(backend, count, workload)
    began = time.perf_counter()
    for row in jobs:
        engine.submit(row)
    while not engine.idle:
        engine.step()
    wall = time.perf_counter() - began
    prompt = sum(row.prompt_tokens for row in jobs)
    return {
        "wall": wall, **spent, "steps": engine.steps, "prompt": prompt,
        "reused": sum(row.cached_tokens for row in done.values()),
        "answers": [done[row.row_id].tokens for row in jobs],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="pairs of runs, reuse on and off")
    parser.add_argument("--quantization", default="nf4", help="the worker's default on the CPU")
    parser.add_argument("--jobs", type=int, default=48)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--model", default="tiny", help="tiny (the worker's) | random-HIDDENxLAYERS")
    parser.add_argument("--workload", default="photo-questions", choices=sorted(WORKLOADS))
    parser.add_argument(
        "--prefill-tokens", type=int, default=1 << 30, help="prefill positions a step (the CPU worker's: 512)"
    )
    args = parser.parse_args()
    source = None if args.model == "tiny" else _random_source(args.model)
    print("| pair (order) | reuse | wall s | prefill s | decode s | admission s | other s | reused |")
    print("|---|---|---|---|---|---|---|---|")
    speedups, bounds = [], []
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        runs = {
            reuse: _run(
                reuse, args.quantization, args.jobs, args.rows, source, args.workload, args.prefill_tokens
            )
            for reuse in order
        }
        on, off = runs[True], runs[False]
        differ = sum(a != b for a, b in zip(on["answers"], off["answers"], strict=True))
        if differ:  # half precision: a split prefill can turn a near tie (docs/design.md)
            print(f"(pair {pair + 1}: {differ} of {len(on['answers'])} answers differ with reuse on and off)")
        for reuse in order:
            r = runs[reuse]
            other = r["wall"] - sum(r[p] for p in PARTS)
            print(
                f"| {pair + 1} ({'on first' if order[0] else 'off first'}) | {'on' if reuse else 'off'} "
                f"| {r['wall']:.2f} | {r['extend']:.2f} | {r['decode']:.2f} | {r['begin']:.2f} | {other:.2f} "
                f"| {r['reused']:,} of {r['prompt']:,} ({r['reused'] / r['prompt']:.0%}) |"
            )
        share, skipped = (off["extend"] + off["begin"]) / off["wall"], on["reused"] / on["prompt"]
        bounds.append(1 / (1 - share * skipped))
        speedups.append(off["wall"] / on["wall"])
        print(
            f"|  | on / off | **{speedups[-1]:.2f}x** | prefill + admission {share:.0%} of time off | | | "
            f"| bound 1 / (1 - {share:.2f} x {skipped:.2f}) = **{bounds[-1]:.2f}x** |"
        )
    print(
        f"\nengine alone, reuse on / off: {statistics.geometric_mean(speedups):.2f}x over {len(speedups)} "
        f"pairs; Amdahl's bound: {statistics.geometric_mean(bounds):.2f}x (goal of the whole system: 2.5x); "
        f"{args.model}, {args.quantization}, {args.workload}"
    )


if __name__ == "__main__":
    main()
