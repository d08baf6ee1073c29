"""GPU: the worker's engine (workers/engine/) on a realistic mix, as the worker configures it, with a
Fuyu-8B-shaped model of random weights (tests/bench/random_fuyu.py).

The mix: a backlog of jobs of mixed image sizes (1 MP photos, full-HD screenshots, 12 MP phone photos
shrunk to fit, small uploads), prompts of 8 / 64 / 200 tokens and 16-128 new tokens, all waiting at
the start, so rows leave and backlog rows join at most steps; tickets (the interactive lane, 32 new
tokens) arrive one every few steps beside it. Every row generates exactly its max_new_tokens (random
weights would otherwise stop at random). The cache is sized as the worker sizes it: the positions of
the longest job allowed per slot, as many slots as the free memory holds (measured after the largest
prefill), at most the row limit.

Jobs about one image share its prefix (the image's positions, and the prompt's first tokens): the
engine's prefix cache reuses them, as the worker's does for one photo's several questions, and long
prefills run in chunks of MRC_ENGINE_PREFILL_TOKENS positions a step (auto: 1,024 on CUDA), as in
the worker.

Each run (`--runs`, e.g. `graphs:16,eager:16,graphs:32,rows:16,graphs:16:noreuse,pool:64:mem16` =
decode mode : row limit [: noreuse, the prefix cache off (MRC_ENGINE_PREFIX_CACHE=off) | : nochunk, one
prefill per row | : memN, a cache of N longest rows' positions whatever the row limit (by default, as
many as the row limit)]; graphs and eager are MRC_ENGINE_DECODE=fixed with MRC_ENGINE_CUDA_GRAPHS=auto
/ off, rows is MRC_ENGINE_DECODE=rows, pool is MRC_ENGINE_DECODE=pool with graphs) reports: generated
tokens/s; prefix hits and positions reused against positions computed, and the steps that computed a
chunk beside a decode; decode-step time by running rows (host clock) and the GPU's span of the same
steps (CUDA events); in a profiled window of steps, the time the GPU's kernels ran against the steps'
wall time (the rest is the host's: building inputs, the slot table, picking tokens, launch gaps);
joins and leaves per step; ticket first-token latency p50 / p99 (from submission, inputs already
prepared); the capture time of the CUDA graphs. Written to --json after each run; a run past
`--run-s` seconds stops where it is (marked `cut_short`).

    python tests/bench/bench_engine_mix.py [--quantization bf16] [--runs graphs:16,eager:16] [--json F]
    python tests/bench/bench_engine_mix.py --smoke     # the tiny Fuyu's shape on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after sys.path is set

from tests.bench import random_fuyu  # noqa: E402 - after sys.path is set
from workers.backends.base import GenerationInput  # noqa: E402 - after sys.path is set
from workers.engine import capacity, scheduler  # noqa: E402 - after sys.path is set
from workers.engine.engine import Engine  # noqa: E402 - after sys.path is set
from workers.engine.sequence import Sequence  # noqa: E402 - after sys.path is set

# (width, height) of the images jobs carry, cycled; 4032x3024 is shrunk to fit 1080x1920 on the device.
SIZES = ((1024, 768), (1920, 1080), (4032, 3024), (320, 240), (1024, 1024), (768, 1024))
SMOKE_SIZES = ((64, 48), (120, 90), (200, 150), (32, 24))
PROMPT_TOKENS = (8, 64, 200)
BACKLOG_NEW = (16, 32, 64, 128)
TICKET_NEW = 32
SET_UP_S = 20  # a run's own set-up, roughly: the largest prefill, the cache, graphs' capture, profiler
MIN_RUN_S = 6.0  # a run shorter than this measures its warm-up: fewer runs are made instead


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


class Mix:
    """The jobs of one run, prepared once (inputs on the device) and reused by every run."""

    def __init__(self, backend: Any, backlog: int, tickets: int, smoke: bool) -> None:
        rng = random.Random(7)
        text = "can I get a refund for this damaged parcel " * 40
        words = backend.processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        sizes = SMOKE_SIZES if smoke else SIZES
        images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for w, h in sizes]
        scale = 8 if smoke else 1  # the smoke run's tokens, shrunk

        def job(index: int, new: int) -> tuple[Any, int, int, Any]:
            prompt = tuple(int(t) for t in words[: max(1, PROMPT_TOKENS[index % 3] // scale)])
            image = index % len(images)
            item = GenerationInput(images[image], "", new, prompt_ids=prompt, exact_steps=True)
            inputs, positions = backend.row_inputs(item)
            # What the worker's identity says of a photo (workers/model_stage.py): its bytes and size.
            return inputs, positions, new, ("mix-image", image, *sizes[image])

        self.backlog = [job(i, max(2, rng.choice(BACKLOG_NEW) // scale)) for i in range(backlog)]
        self.tickets = [job(i + 1, max(2, TICKET_NEW // scale)) for i in range(tickets)]


def engine_limits(
    backend: Any, rows: int, memory_rows: int | None = None
) -> tuple[scheduler.Limits, int, dict[str, Any]]:
    """The worker's sizing (workers/model_stage.py) with `rows` as MRC_MODEL_BATCH_MAX_JOBS and a token
    budget of `memory_rows` (else `rows`) longest rows (by need, the same pool holds more short ones)."""
    settings = backend.settings
    positions = backend.slot_positions()
    fit, measured = backend.kv_capacity()
    decode = backend.decode_mode()
    grain = capacity.slot_grain(decode, backend.device)
    slots, pool = capacity.choose(
        fit, rows, (memory_rows or rows) * positions, positions, decode == "fixed", grain
    )
    chunk = capacity.prefill_tokens(settings.engine_prefill_tokens, backend.device)
    limits = scheduler.Limits(
        max_rows=slots,
        reserved_interactive=min(settings.engine_reserved_rows, slots - 1),
        backlog_prefill_tokens=chunk,
        backlog_share=settings.engine_backlog_share,
        prefill_tokens=chunk,
        hold_backlog=backend.device == "cpu",  # MRC_ENGINE_HOLD_BACKLOG=auto
    )
    sizing = {"positions_memory_holds": fit, "measured_from": measured, "slots": slots, "pool": pool}
    return limits, positions, sizing


@dataclass(frozen=True)
class Step:
    rows: int  # rows decoded
    wall_ms: float
    gpu_ms: float | None
    joins: int  # rows prefilled (each made its first token)
    leaves: int  # rows finished
    profiled: bool
    computed: int = 0  # prefill positions computed (chunks)
    reused: int = 0  # prefix positions reused from the cache, not computed
    lookups: int = 0  # rows admitted that could reuse a prefix
    hits: int = 0  # of those, rows that did


class StepTimer:
    """Host wall time and the GPU's span (CUDA events) of each engine step."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.rows: list[Step] = []
        self.profiling = False  # steps under the profiler: their host time is inflated, kept out of by_rows

    def step(self, engine: Engine) -> Any:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        report = engine.step()
        gpu = None
        if self.cuda:
            end.record()
            end.synchronize()
            gpu = start.elapsed_time(end)
        wall = (time.perf_counter() - began) * 1000
        self.rows.append(
            Step(
                report.decoded_rows, wall, gpu, report.prefilled, report.finished, self.profiling,
                report.computed, report.reused, report.lookups, report.hits,
            )
        )  # fmt: skip
        return report

    def by_rows(self) -> dict[str, dict[str, Any]]:
        """Median step time by rows decoded, over steps that prefilled nothing (pure decode steps)."""
        groups: dict[int, list[tuple[float, float | None]]] = {}
        for step in self.rows:
            if step.rows and not step.joins and not step.profiled:
                groups.setdefault(step.rows, []).append((step.wall_ms, step.gpu_ms))
        out = {}
        for rows, times in sorted(groups.items()):
            gpus = [g for _, g in times if g is not None]
            out[str(rows)] = {
                "steps": len(times),
                "wall_ms": round(statistics.median(w for w, _ in times), 3),
                "gpu_span_ms": round(statistics.median(gpus), 3) if gpus else None,
            }
        return out


def kernel_window(engine: Engine, timer: StepTimer, steps: int) -> dict[str, Any] | None:
    """Steps run under the profiler: the kernels' own time against the steps' wall time."""
    if not timer.cuda or engine.idle:
        return None
    from torch.profiler import ProfilerActivity, profile

    began, done = time.perf_counter(), 0
    timer.profiling = True
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        while done < steps and not engine.idle:
            timer.step(engine)
            done += 1
        torch.cuda.synchronize()
    timer.profiling = False
    wall = (time.perf_counter() - began) * 1000
    from torch.autograd import DeviceType

    kernels = (
        sum(  # the device's own events only: a CPU op's device time repeats its kernels'
            e.self_device_time_total
            for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        )
        / 1000
    )
    return {
        "steps": done,
        "wall_ms_per_step": round(wall / max(1, done), 3),
        "kernel_ms_per_step": round(kernels / max(1, done), 3),
        "gpu_busy_share": round(kernels / wall, 3) if wall else None,
    }


def run(backend: Any, mix: Mix, spec: str, args: argparse.Namespace) -> dict[str, Any]:
    decode, rows, *options = spec.split(":")
    backend.settings = backend.settings.model_copy(
        update={
            "engine_decode": decode if decode in ("rows", "pool") else "fixed",
            "engine_cuda_graphs": "off" if decode == "eager" else "auto",
            "engine_prefix_cache": "off" if "noreuse" in options else "on",
            "engine_prefill_tokens": 1 << 20 if "nochunk" in options else "auto",
        }
    )
    random_fuyu.free(backend.device)
    memory = next((int(o[3:]) for o in options if o.startswith("mem")), None)
    limits, positions, sizing = engine_limits(backend, int(rows), memory)
    runner = backend.step_model(limits.max_rows, positions, sizing["pool"])
    began = time.perf_counter()
    captured = backend.capture(runner)
    figures: dict[str, Any] = {
        "run": spec,
        **sizing,
        "slot_positions": positions,
        "cache_gib": round(runner.cache.nbytes / 2**30, 3),
        "decode": runner.decode_mode,
        "cuda_graphs": captured,
        "capture_s": round(time.perf_counter() - began, 2),
    }
    done: list[Sequence] = []
    engine = Engine(runner, limits, done.append)
    for index, (inputs, positions_, new, _) in enumerate(mix.backlog[:2]):  # warm: first kernels, handles
        engine.submit(Sequence(f"warm-{index}", inputs, positions_, new, backend.eos_id, exact_steps=True))
    while not engine.idle:
        engine.step()
    done.clear()
    for index, (inputs, positions_, new, identity) in enumerate(mix.backlog):
        engine.submit(
            Sequence(f"b{index}", inputs, positions_, new, backend.eos_id, lane="backlog", exact_steps=True,
                     identity=identity)
        )  # fmt: skip
    timer, tickets = StepTimer(backend.device), list(mix.tickets)
    window: dict[str, Any] | None = None
    began = time.perf_counter()
    cut_short = False
    while not engine.idle or tickets:
        if tickets and engine.steps % args.ticket_every == 0:
            inputs, positions_, new, identity = tickets.pop(0)
            ticket = Sequence(
                f"t{len(tickets)}",
                inputs,
                positions_,
                new,
                backend.eos_id,
                exact_steps=True,
                identity=identity,
            )
            ticket.submitted_at = time.time()
            engine.submit(ticket)
        if window is None and len(timer.rows) >= args.profile_after:
            window = kernel_window(engine, timer, args.profile_steps)
        else:
            timer.step(engine)
        if time.perf_counter() - began > args.run_s:
            cut_short = True
            break
    seconds = time.perf_counter() - began
    steps = timer.rows
    generated = sum(s.rows + s.joins for s in steps)  # a prefill makes each joining row's first token
    firsts = [
        (row.first_token_at - row.submitted_at) * 1000
        for row in done
        if row.lane == scheduler.INTERACTIVE and row.first_token_at is not None
    ]
    decode_steps = [s for s in steps if s.rows]
    figures.update(
        {
            "cut_short": cut_short,
            "seconds": round(seconds, 2),
            "steps": len(steps),
            "finished_rows": len(done),
            "generated_tokens_per_s": round(generated / seconds, 1),
            "steps_with_join": round(sum(1 for s in steps if s.joins) / max(1, len(steps)), 3),
            "steps_with_leave": round(sum(1 for s in steps if s.leaves) / max(1, len(steps)), 3),
            "mean_rows_per_decode_step": round(statistics.mean(s.rows for s in decode_steps), 2)
            if decode_steps
            else 0,
            "step_ms_by_rows": timer.by_rows(),
            "prefix": {
                "lookups": sum(s.lookups for s in steps),
                "hits": sum(s.hits for s in steps),
                "positions_reused": sum(s.reused for s in steps),
                "positions_computed": sum(s.computed for s in steps),
            },
            # steps that computed a prefill chunk and decoded running rows too (chunks between decodes)
            "steps_with_chunk_and_decode": sum(1 for s in steps if s.computed and s.rows),
            "kernel_window": window,
            "tickets": {
                "count": len(firsts),
                "first_token_ms_p50": round(percentile(firsts, 0.5) or 0, 2) if firsts else None,
                "first_token_ms_p99": round(percentile(firsts, 0.99) or 0, 2) if firsts else None,
                "first_token_ms_max": round(max(firsts), 2) if firsts else None,
            },
        }
    )
    del engine, runner
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="bf16", choices=["bf16", "nf4"])
    parser.add_argument(
        "--runs",
        default="graphs:16,graphs:16:noreuse,pool:64:mem16,pool:16,graphs:32,eager:16,rows:16",
        help="by priority (when the time limit cannot hold them all, the last are left out): the pair for "
        "prefix reuse on and off first; then the pool step (slots by need, captured) in the memory of 16 "
        "longest rows, and beside graphs:16's rows; rows:16 is the CPU's path, each row's slot its need "
        "(CUDA's fixed steps keep slots of the longest job); also graphs:16:nochunk",
    )
    parser.add_argument("--backlog", type=int, default=96)
    parser.add_argument("--tickets", type=int, default=12)
    parser.add_argument("--ticket-every", type=int, default=25, help="steps between ticket arrivals")
    parser.add_argument("--run-s", type=float, default=16.0, help="a run stops after this many seconds")
    parser.add_argument("--profile-after", type=int, default=60, help="steps before the profiled window")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny shape and sizes on the CPU")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.runs, args.backlog, args.tickets = "rows:4,eager:4,rows:4:noreuse,pool:8:mem4", 10, 3
        args.ticket_every = 4
    elif not torch.cuda.is_available():
        raise SystemExit("bench_engine_mix.py needs CUDA (or --smoke, on the CPU)")
    figures: dict[str, Any] = {"device": device, "quantization": args.quantization, "runs": []}
    began = time.perf_counter()
    source = random_fuyu.build(
        random_fuyu.config_of("tiny" if args.smoke else "fuyu-8b"), device, torch.bfloat16
    )
    backend = random_fuyu.backend(source, args.quantization, device)
    figures["warm_up"] = random_fuyu.warm_up(backend)
    figures["load_error"] = backend.load_error
    if args.quantization != "bf16":
        backend.source_model = source = None
    mix = Mix(backend, args.backlog, args.tickets, args.smoke)
    figures["setup_s"] = round(time.perf_counter() - began, 2)
    print(f"model and {args.backlog + args.tickets} jobs ready in {figures['setup_s']} s", flush=True)
    # The proving ground's step limit (scripts/gpu_checks.sh): runs shrink to fit it rather than be killed.
    deadline = time.monotonic() + float(os.environ.get("GPU_STEP_LIMIT_S", "inf")) - figures["setup_s"] - 10
    specs, set_up, longest = args.runs.split(","), 1 if args.smoke else SET_UP_S, args.run_s
    # Runs are listed by priority: when the limit cannot hold them all, the last ones are left out, and
    # the first ones keep a share long enough to measure (an early run never gives its time to a later).
    fit = len(specs)
    while fit > 1 and (deadline - time.monotonic()) / fit - set_up < MIN_RUN_S:
        fit -= 1
    for index, spec in enumerate(specs):
        share = (deadline - time.monotonic()) / max(1, fit - index) - set_up
        if index >= fit or share < 3:
            figures["runs"].append({"run": spec, "skipped": "out of time (GPU_STEP_LIMIT_S)"})
            continue
        args.run_s = min(longest, share)
        try:
            figures["runs"].append(run(backend, mix, spec, args))
        except Exception as exc:  # a run's failure (a capture, out of memory) keeps the others' figures
            traceback.print_exc()
            figures["runs"].append({"run": spec, "error": f"{type(exc).__name__}: {exc}"[:500]})
        print(json.dumps(figures["runs"][-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2, default=str))
    backend.close()
    if any("error" in r for r in figures["runs"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
