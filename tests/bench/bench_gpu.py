"""GPU only: a randomly initialised Fuyu-8B-sized model (the real config, no weights needed), NF4 and bf16,
loaded through mrc's own loader (workers/backends/fuyu.py).

Rows per mode:
  decode   batches of 1, 8 and 32 images of 1024x1024, 64-token prompts, exactly 64 new tokens each
           (the end-of-text token is ignored: a random model that stops early would inflate images/s);
           images/s, generated tokens/s, peak GPU memory, fraction of the roofline (~20-26 images/s
           at batch 32 on an H200, docs/benchmarks.md)
  prefill  the prefill-heavy workload through the real pipeline's preprocessing on the device: JPEG
           bytes of 12 MP phone photos, full-HD screenshots and small images decoded by workers/images.py
           (nvjpeg) and prepared by the backend, 16 new tokens, static batches of 1 and 8
  engine   the worker's iteration-level engine (workers/engine/) on the decode row's jobs, at most
           1, 8 and 32 rows: images/s against the static `generate()` batch of the same size, and the
           engine's cache capacity measured from free memory (what /readyz reports)
  structured  16 rows all grammar-constrained vs none (generated tokens/s, the same steps), one step's
           mask alone, and grammar compile times cold and cached (tests/bench/bench_structured.py)
Every figure is also written to --json.

    MRC_DEVICE=cuda .venv/bin/python tests/bench/bench_gpu.py [--modes nf4,bf16] [--batches 1,8,32] [--json F]
    .venv/bin/python tests/bench/bench_gpu.py --tiny     # smoke test of the script itself, on the CPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after sys.path is set

from shared.settings import Settings  # noqa: E402 - after sys.path is set
from tests.bench import bench_structured  # noqa: E402 - after sys.path is set
from workers.backends.base import GenerationInput  # noqa: E402 - after sys.path is set
from workers.backends.fuyu import FuyuBackend  # noqa: E402 - after sys.path is set
from workers.backends.tiny import ensure_tiny_model  # noqa: E402 - after sys.path is set

ROOFLINE_B32 = (20.0, 26.0)  # images/s, H200, batch 32, 1024^2, 64 + 64 tokens (derived, STACK-NOTES.md)


def build_random_model(folder: Path, tiny: bool) -> None:
    """Fuyu-8B's config with random weights, saved next to the tiny Fuyu's tokenizer and processor."""
    from transformers import AutoProcessor, FuyuConfig, FuyuForCausalLM

    tiny_dir = ensure_tiny_model(str(ROOT / ".cache" / "mrc"))
    processor = AutoProcessor.from_pretrained(tiny_dir, local_files_only=True)
    processor.save_pretrained(folder)
    speaker = processor.tokenizer.convert_tokens_to_ids("|SPEAKER|")
    if tiny:
        config = FuyuConfig.from_pretrained(tiny_dir)
    else:
        config = FuyuConfig(image_token_id=speaker, pad_token_id=0)  # the defaults are Fuyu-8B's
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = FuyuForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def prompt_of(backend: FuyuBackend, tokens: int) -> str:
    words = "can I get a refund for this damaged parcel please " * 40
    ids = backend.processor.tokenizer(words, add_special_tokens=False)["input_ids"][:tokens]
    return str(backend.processor.tokenizer.decode(ids))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prefill_row(backend: FuyuBackend, device: str, batch: int, repeats: int) -> dict[str, float]:
    """The prefill-heavy workload, through the worker's own decode and preprocessing on the device."""
    from tests.support import imagegen
    from workers import images

    datas = [
        imagegen.camera_photo(4032, 3024, seed=1),
        imagegen.screenshot(1920, 1080, seed=2),
        imagegen.camera_photo(4000, 3000, seed=3),
        imagegen.camera_photo(320, 240, seed=4),
    ]
    prompts = ["Refund?", prompt_of(backend, 16), prompt_of(backend, 64)]
    jobs = [(datas[i % 4], prompts[i % 3]) for i in range(max(8, batch * 2))]

    def once() -> int:
        done = 0
        for start in range(0, len(jobs), batch):
            group = jobs[start : start + batch]
            tensors = [images.load(data, 10**9, device=device).tensor for data, _ in group]
            items = [
                GenerationInput(t, p, 16, exact_steps=True) for t, (_, p) in zip(tensors, group, strict=True)
            ]
            backend.generate(items)
            done += len(items)
        return done

    once()
    _sync(device)
    began = time.perf_counter()
    done = sum(once() for _ in range(repeats))
    _sync(device)
    return {"batch": batch, "images_per_s": done / (time.perf_counter() - began)}


def engine_row(backend: FuyuBackend, items: list[GenerationInput], device: str, repeats: int) -> float:
    """images/s of the engine running these jobs (all submitted at once, at most len(items) rows)."""
    from workers.engine import scheduler
    from workers.engine.engine import Engine
    from workers.engine.sequence import Sequence

    def once() -> int:
        done: list[Sequence] = []
        engine = Engine(backend.step_model(len(items)), scheduler.Limits(len(items), 0), done.append)
        for index, item in enumerate(items):
            inputs, positions = backend.row_inputs(item)
            engine.submit(
                Sequence(str(index), inputs, positions, item.max_new_tokens, backend.eos_id, exact_steps=True)
            )
        while not engine.idle:
            engine.step()
        return len(done)

    once()  # warm this shape
    _sync(device)
    began = time.perf_counter()
    done = sum(once() for _ in range(repeats))
    _sync(device)
    return done / (time.perf_counter() - began)


def run_mode(folder: Path, mode: str, batches: list[int], device: str, repeats: int) -> dict[str, object]:
    backend = FuyuBackend(Settings(model=str(folder), quantization=mode, device=device))
    began = time.perf_counter()
    backend.load()
    load_s = time.perf_counter() - began
    kernel = backend.warm_up()
    prompt = prompt_of(backend, 64)
    image = torch.randint(
        0, 256, (3, 1024, 1024), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    print(
        f"[{mode}] loaded in {load_s:.1f} s, attention {backend.describe()['attention_backend']} ({kernel})"
    )
    figures: dict[str, object] = {
        "mode": mode,
        "load_s": load_s,
        "attention": backend.describe(),
        "decode": [],
    }
    for batch in batches:
        items = [GenerationInput(image, prompt, 64, exact_steps=True) for _ in range(batch)]
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        backend.generate(items)  # warm this shape
        began = time.perf_counter()
        tokens = 0
        for _ in range(repeats):
            tokens += sum(out.output_tokens for out in backend.generate(items))
        _sync(device)
        seconds = time.perf_counter() - began
        rate = batch * repeats / seconds
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")
        line = (
            f"[{mode}] batch {batch:>2}: {rate:7.2f} images/s, {tokens / seconds:8.1f} generated tokens/s "
            f"({tokens / (batch * repeats):.0f} per image), peak GPU memory {peak:6.1f} GiB"
        )
        row = {"batch": batch, "images_per_s": rate, "tokens_per_s": tokens / seconds, "peak_gib": peak}
        if batch == 32:
            line += f", roofline fraction {rate / ROOFLINE_B32[1]:.2f}-{rate / ROOFLINE_B32[0]:.2f}"
            row["roofline_fraction"] = [rate / ROOFLINE_B32[1], rate / ROOFLINE_B32[0]]
        row["engine_images_per_s"] = engine_row(backend, items, device, repeats)
        line += (
            f"; engine {row['engine_images_per_s']:7.2f} images/s ({row['engine_images_per_s'] / rate:.2f}x)"
        )
        figures["decode"].append(row)  # type: ignore[attr-defined]
        print(line, flush=True)
    kv_tokens, measured_from = backend.kv_capacity()
    figures["engine_kv"] = {"tokens": kv_tokens, "measured_from": measured_from}
    print(f"[{mode}] engine cache capacity {kv_tokens} positions ({measured_from})", flush=True)
    figures["prefill"] = [prefill_row(backend, device, b, repeats) for b in (1, 8)]
    for row in figures["prefill"]:  # type: ignore[attr-defined]
        print(
            f"[{mode}] prefill-heavy, batch {row['batch']:>2}: {row['images_per_s']:7.2f} images/s",
            flush=True,
        )
    # Structured answers: 16 rows all constrained vs none, same steps (tests/bench/bench_structured.py).
    # The mask's fill cost grows with the tokenizer's vocabulary: this model has the tiny tokenizer (no
    # Fuyu-8B tokenizer without the weights' repository), so the fill is a lower bound on Fuyu-8B's.
    figures["structured"] = {
        "overhead": bench_structured.overhead(backend, 16, 64, repeats),
        "mask_step_ms": bench_structured.mask_step_ms(backend, 16),
        "compile": bench_structured.compile_times(backend),
    }
    print(f"[{mode}] structured answers: {figures['structured']}", flush=True)
    del backend
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description="Fuyu-8B-sized throughput on one GPU")
    parser.add_argument("--modes", default="nf4,bf16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="smoke-test the script on the tiny config (CPU)")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device == "cpu" and not args.tiny:
        raise SystemExit("bench_gpu.py needs CUDA (or --tiny for a smoke test)")
    folder = Path(tempfile.mkdtemp(prefix="fuyu-random-"))
    try:
        began = time.perf_counter()
        build_random_model(folder, args.tiny)
        print(
            f"random {'tiny' if args.tiny else 'Fuyu-8B'} model built in {time.perf_counter() - began:.0f} s"
        )
        results = []
        for mode in args.modes.split(","):
            results.append(
                run_mode(folder, mode, [int(b) for b in args.batches.split(",")], device, args.repeats)
            )
            if args.json:  # after each mode: a run cut short by its timeout keeps what it measured
                args.json.write_text(json.dumps({"device": device, "modes": results}, indent=2, default=str))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
