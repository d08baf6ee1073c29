"""What one decode step of the engine costs, by shape: rows x positions, and one long row among short
ones. Each shape is timed, interleaved in one run, four ways (those the device has):

  dynamic    the cache before slots, for comparison: transformers' DynamicCache left-padded to the
             longest row and a 2-D mask (every row pays the batch's width; every layer's cache is
             concatenated anew at every step)
  rows       the engine's CPU step: each row attends to its own length in its own slot
  fixed      the engine's GPU step: one call of fixed shape over a prefix of the slots (eager)
  compiled   the fixed step through torch.compile (inductor, fullgraph) on the CPU, for the shapes
             named by --compile (inductor takes tens of seconds per shape here)
  graphs     the fixed step captured as a CUDA graph and replayed (CUDA only; --graphs on|both)
  pool       the pool step (MRC_ENGINE_DECODE=pool): one call of fixed shape over the pool's used
             positions, slots by need, each row masked to its own (eager)
  poolgraphs the pool step captured as a CUDA graph and replayed (CUDA only; --graphs on|both)

What a prefill costs, whole, in chunks, as a prefix hit, and several rows' chunks in one call: the
prefill table, tests/bench/bench_prefill.py (here until the twelfth session).

For each decode shape: the median step time; bytes the cache bookkeeping writes per step (goal: one
position per running row; `dynamic` rewrites the whole cache); and the host time outside the model
call as a share of the step (building inputs, the slot table, picking tokens; goal <= 5 % at 16 rows).
Caches hold random keys and values: a step's cost does not depend on them.

    .venv/bin/python tests/bench/bench_step_cost.py [--rows 1,4,16,32] [--positions 300,1300,2400]
        [--compile 1x1300,16x1300] [--repeats 5] [--json F] [--quick]
    python tests/bench/bench_step_cost.py --device cuda --model fuyu-8b-shape --graphs both --json F
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from workers.engine import pool_step  # noqa: E402 - after sys.path is set
from workers.engine.fixed_step import StaticStep  # noqa: E402 - after sys.path is set
from workers.engine.runner import Runner  # noqa: E402 - after sys.path is set

DEFAULT_COMPILE = "1x1300,16x1300"
MIXED = "mixed"  # one row of the longest positions among rows of the shortest


def load_model(name: str, device: str, dtype: torch.dtype) -> tuple[Any, Callable[[int, str], object] | None]:
    """The model and the engine's CPU thread policy (None on CUDA). `tiny`: the tiny Fuyu the tests use,
    through the worker's own loading path; `fuyu-8b-shape`: Fuyu-8B's configuration, random weights,
    built on the device (nothing read from disk); `random-HxL`: the tiny Fuyu's kind, hidden H, L layers."""
    if name == "tiny":
        from shared.settings import Settings
        from workers.backends.fuyu import FuyuBackend

        quantization: Any = "fp32" if dtype == torch.float32 else "bf16"
        settings = Settings(
            model="tiny", home=str(ROOT / ".cache" / "mrc"), quantization=quantization, device=device
        )
        backend = FuyuBackend(settings)
        backend.load()
        threads = backend.step_model(1, 8).threads if device == "cpu" else None
        return backend.model, threads
    from transformers import FuyuConfig, FuyuForCausalLM

    config = FuyuConfig()  # Fuyu-8B's
    if name != "fuyu-8b-shape":  # random-HIDDENxLAYERS: the tiny Fuyu's shape, wider and deeper
        hidden, layers = (int(part) for part in name.removeprefix("random-").split("x"))
        fields: dict[str, Any] = dict(
            vocab_size=448, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            num_attention_heads=max(1, hidden // 64), max_position_embeddings=8192, hidden_act="relu2",
            qk_layernorm=True, partial_rotary_factor=0.5, pad_token_id=0,
        )  # fmt: skip
        config = FuyuConfig(**fields)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = FuyuForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(before)
    policy: Callable[[int, str], object] | None = None
    if device == "cpu":
        from workers import cpu_threads

        policy = lambda count, kind: cpu_threads.apply(0, count, kind)  # noqa: E731 - the worker's policy
    return model, policy


def shapes(rows: list[int], positions: list[int]) -> list[tuple[int, list[int]]]:
    """(rows, each row's length) per shape: every rows x positions, then a mixed-width batch."""
    grid = [(r, [p] * r) for r in rows for p in positions]
    wide = max(rows)
    if wide > 1:
        grid.append((wide, [max(positions)] + [min(positions)] * (wide - 1)))
    return grid


def label(lengths: list[int]) -> str:
    if len(set(lengths)) > 1:
        return f"{len(lengths)} ({MIXED}: 1 x {lengths[0]}, {len(lengths) - 1} x {lengths[1]})"
    return f"{len(lengths)} x {lengths[0]}"


class Clock:
    """Time inside the model call of a step (hooks), so the rest of the step is the host's."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync, self.inside, self._began = sync, 0.0, 0.0

    def enter(self, *_: Any) -> None:
        self.sync()
        self._began = time.perf_counter()

    def leave(self, *_: Any) -> None:
        self.sync()
        self.inside += time.perf_counter() - self._began

    @contextmanager
    def around(self, module: Any) -> Iterator[None]:
        handles = [module.register_forward_pre_hook(self.enter), module.register_forward_hook(self.leave)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def engine_runner(
    model: Any, threads: Any, lengths: list[int], mode: str, repeats: int
) -> tuple[Runner, Any]:
    """A runner whose slots hold these rows (random cache contents), and the batch of them."""
    decode: Any = "pool" if mode.startswith("pool") else "fixed" if mode != "rows" else "rows"
    runner = Runner(model, len(lengths), max(lengths) + repeats + 8, threads, decode)
    for layer in (*runner.cache.keys, *runner.cache.values):
        layer.normal_()
    batch = runner.new_batch()
    for index, length in enumerate(lengths):
        runner.table.assign(f"r{index}", length, length + repeats)  # by need (uniform: the grid's slot)
    batch.row_ids = [f"r{index}" for index in range(len(lengths))]
    return runner, batch


def time_engine(
    model: Any, threads: Any, lengths: list[int], mode: str, repeats: int, sync: Any
) -> dict[str, float]:
    """Median step ms, bookkeeping bytes written per step, host share outside the model call."""
    runner, batch = engine_runner(model, threads, lengths, mode, repeats + 2)
    tokens = [1] * len(lengths)
    written = _counting(runner.cache)
    if mode in ("compiled", "graphs", "poolgraphs"):
        _prepare(runner, lengths, mode)
    runner.decode(batch, tokens)  # warm: first call of this shape
    written["bytes"] = 0
    clock = Clock(sync)
    steps, model_time = [], []
    originals = StaticStep.run
    StaticStep.run = lambda self: _timed(clock, originals, self)  # type: ignore[method-assign]
    try:
        for _ in range(repeats):
            clock.inside = 0.0
            sync()
            began = time.perf_counter()
            with _rows_clock(clock, runner, mode):
                runner.decode(batch, tokens)
            sync()
            steps.append(time.perf_counter() - began)
            model_time.append(clock.inside)
    finally:
        StaticStep.run = originals  # type: ignore[method-assign]
    step = statistics.median(steps)
    host = statistics.median(s - m for s, m in zip(steps, model_time, strict=True))
    captured = mode in ("compiled", "graphs", "poolgraphs")
    bytes_per_step = written["bytes"] / repeats if not captured else float("nan")
    return {"ms": step * 1000, "bytes": bytes_per_step, "host_share": host / step}


def _timed(clock: Clock, run: Any, step: StaticStep) -> Any:
    clock.enter()
    out = run(step)
    clock.leave()
    return out


@contextmanager
def _rows_clock(clock: Clock, runner: Runner, mode: str) -> Iterator[None]:
    if mode != "rows":
        yield
        return
    with clock.around(runner.language), clock.around(runner.model.lm_head):
        yield


def _counting(cache: Any) -> dict[str, int]:
    """Count what the cache's update writes (eager steps only: a compiled or captured step is not
    Python any more, and writes the same)."""
    written = {"bytes": 0}
    update = cache.update

    def counted(keys: torch.Tensor, values: torch.Tensor, layer: int, *rest: Any, **kw: Any) -> Any:
        written["bytes"] += 2 * keys.numel() * keys.element_size()  # [rows, h, 1, d] or [1, h, rows, d]
        return update(keys, values, layer, *rest, **kw)

    cache.update = counted
    return written


def _prepare(runner: Runner, lengths: list[int], mode: str) -> None:
    """Compile or capture the fixed-shape step of this batch's shape before it is timed."""
    from workers.engine.fixed_step import FixedStep, rows_bucket, width_bucket

    table = runner.table
    if mode == "poolgraphs":
        starts = [table.start(f"r{index}") for index in range(len(lengths))]
        reach = max(start + length + 1 for start, length in zip(starts, lengths, strict=True))
        rows = pool_step.step_rows(len(lengths), table.slots, runner.cache.keys[0].device)
        step: Any = runner.step(rows, pool_step.extent_bucket(reach, table.pool, table.grain))
        step.fill(starts, lengths, [1] * len(lengths))
    else:
        step = runner.step(
            rows_bucket(table.top, table.slots), width_bucket(max(lengths) + 1, table.positions)
        )
        assert isinstance(step, FixedStep)
        step.fill(list(range(len(lengths))), lengths, [1] * len(lengths))
    del runner.cache.update  # the class's own again: no counting inside a graph
    if mode in ("graphs", "poolgraphs"):
        with torch.inference_mode():
            step.capture(torch.cuda.graph_pool_handle())
        return
    compiled = torch.compile(step.forward, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        compiled()
    step.forward = compiled  # type: ignore[method-assign]


@torch.inference_mode()
def time_dynamic(model: Any, lengths: list[int], repeats: int, sync: Any) -> dict[str, float]:
    """The cache before slots: DynamicCache left-padded to the longest row, a 2-D mask."""
    from transformers import DynamicCache

    language = model.model.language_model
    text = language.config
    heads = int(text.num_attention_heads)
    dim = int(text.hidden_size) // heads
    width = max(lengths)
    embeddings = language.get_input_embeddings()
    device, dtype = embeddings.weight.device, embeddings.weight.dtype
    cache = DynamicCache()
    for layer in range(int(text.num_hidden_layers)):
        shape = (len(lengths), heads, width, dim)
        cache.update(
            torch.randn(shape, dtype=dtype, device=device),
            torch.randn(shape, dtype=dtype, device=device),
            layer,
        )
    mask = torch.zeros((len(lengths), width), dtype=torch.long, device=device)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    positions = torch.tensor(lengths, device=device).unsqueeze(1)
    ids = torch.ones((len(lengths), 1), dtype=torch.long, device=device)
    written = {"bytes": 0}
    update = cache.update

    def counted(keys: torch.Tensor, values: torch.Tensor, layer: int, *rest: Any, **kw: Any) -> Any:
        out = update(keys, values, layer, *rest, **kw)
        written["bytes"] += sum(t.numel() * t.element_size() for t in out)  # the concatenation writes it all
        return out

    cache.update = counted  # type: ignore[method-assign,assignment]
    steps = []
    for repeat in range(repeats + 1):
        mask = torch.cat([mask, torch.ones((len(lengths), 1), dtype=mask.dtype, device=device)], dim=1)
        sync()
        began = time.perf_counter()
        hidden = language(
            inputs_embeds=embeddings(ids),
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
        ).last_hidden_state
        model.lm_head(hidden[:, -1]).argmax(-1).tolist()
        sync()
        if repeat:  # the first is the warm-up
            steps.append(time.perf_counter() - began)
        else:
            written["bytes"] = 0
        positions = positions + 1
    return {
        "ms": statistics.median(steps) * 1000,
        "bytes": written["bytes"] / repeats,
        "host_share": float("nan"),
    }


def measure(
    model: Any, threads: Any, lengths: list[int], modes: list[str], repeats: int, sync: Any
) -> dict[str, Any]:
    """One shape, every mode; a mode the device has no memory for reads NaN."""
    figures: dict[str, Any] = {"shape": label(lengths), "rows": len(lengths), "lengths": lengths}
    for mode in modes:
        try:
            if mode == "dynamic":
                figures[mode] = time_dynamic(model, lengths, repeats, sync)
            else:
                figures[mode] = time_engine(model, threads, lengths, mode, repeats, sync)
        except torch.cuda.OutOfMemoryError:
            figures[mode] = {"ms": float("nan"), "bytes": float("nan"), "host_share": float("nan")}
            torch.cuda.empty_cache()
    return figures


def parse_compile(text: str) -> set[tuple[int, int]]:
    return {(int(r), int(p)) for r, p in (item.split("x") for item in text.split(",") if item)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--model", help="tiny | random-HIDDENxLAYERS (e.g. random-256x4) | fuyu-8b-shape; default: tiny on "
        "the CPU, fuyu-8b-shape on CUDA",
    )  # fmt: skip
    parser.add_argument("--dtype", choices=["fp32", "bf16"], help="default: fp32 on cpu, else bf16")
    parser.add_argument("--rows", default="1,4,16,32")
    parser.add_argument("--positions", default="300,1300,2400")
    parser.add_argument("--compile", default=DEFAULT_COMPILE, help="CPU: shapes also timed compiled")
    parser.add_argument("--graphs", choices=["on", "off", "both"], default="both", help="CUDA: graphs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="rows 1,4 x positions 64,200: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.positions, args.repeats = "1,4", "64,200", 2
        args.compile = args.compile if args.compile != DEFAULT_COMPILE else ""
    cuda = args.device.startswith("cuda")
    model_name = args.model or ("fuyu-8b-shape" if cuda else "tiny")
    dtype = torch.bfloat16 if (args.dtype or ("bf16" if cuda else "fp32")) == "bf16" else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, threads = load_model(model_name, args.device, dtype)
    modes = ["dynamic", "rows", "fixed", "pool"]
    if cuda and args.graphs in ("on", "both"):
        modes += ["graphs", "poolgraphs"]
    if cuda and args.graphs == "on":
        modes.remove("fixed")
        modes.remove("pool")
    compile_shapes = set() if cuda else parse_compile(args.compile)
    rows = [int(r) for r in args.rows.split(",")]
    positions = [int(p) for p in args.positions.split(",")]
    results: list[dict[str, Any]] = []
    time_dynamic(model, [8, 8], 1, sync)  # the process's first model calls: warm-up, not a figure
    time_engine(model, threads, [8, 8], "rows", 1, sync)
    # Under a step limit (the GPU proving ground's GPU_STEP_LIMIT_S): no new shape past 75 % of it,
    # and the figures so far are written after every shape, so a run cut short still reports.
    limit = float(os.environ.get("GPU_STEP_LIMIT_S", "0") or 0)
    began = time.monotonic()
    for count, lengths in shapes(rows, positions):
        if limit and time.monotonic() - began > 0.75 * limit:
            print(f"  (stopped: {limit:g} s step limit; shapes left out)", flush=True)
            break
        wanted = list(modes)
        if not cuda and (count, lengths[0]) in compile_shapes and len(set(lengths)) == 1:
            wanted.append("compiled")
        figures = measure(model, threads, lengths, wanted, args.repeats, sync)
        results.append(figures)
        print(_line(figures), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"model": model_name, "device": args.device, "steps": results}))
    _table(results, modes + (["compiled"] if compile_shapes else []))
    threads_now = torch.get_num_threads()
    print(
        f"({model_name}, {dtype}, {args.device}, {threads_now} threads at the end, median of {args.repeats})"
    )


def _line(figures: dict[str, Any]) -> str:
    parts = [f"{m} {v['ms']:.1f} ms" for m, v in figures.items() if isinstance(v, dict)]
    return f"  {figures['shape']}: " + ", ".join(parts)


def _table(results: list[dict[str, Any]], modes: list[str]) -> None:
    head = " | ".join(f"{m} ms" for m in modes)
    print(f"\n| rows x positions | {head} | dynamic / rows | bytes written per step, dynamic -> slots "
          "| host share, rows / fixed |")  # fmt: skip
    print("|---" * (len(modes) + 4) + "|")
    for r in results:
        cells = [f"{r[m]['ms']:.1f}" if m in r else "-" for m in modes]
        ratio = r["dynamic"]["ms"] / r["rows"]["ms"]
        copied = f"{_mb(r['dynamic']['bytes'])} -> {_mb(r['rows']['bytes'])}"
        host = f"{r['rows']['host_share']:.0%} / {r['fixed']['host_share']:.0%}" if "fixed" in r else "-"
        print(f"| {r['shape']} | " + " | ".join(cells) + f" | {ratio:.1f}x | {copied} | {host} |")


def _mb(count: float) -> str:
    return f"{count / 2**20:.2f} MiB" if count >= 2**20 else f"{count / 1024:.1f} KiB"


if __name__ == "__main__":
    main()
