"""GPU: images/s of a Fuyu-8B-shaped model with random weights (tests/bench/random_fuyu.py: built on
the device, no weights needed), bf16 and NF4 sharing the same weights, through mrc's own backend.

For each mode and batch (1, 8, 32): 1024x1024 images, 64-token prompts, exactly 64 new tokens per image
(end-of-text ignored: a random model that stopped early would inflate images/s), static `generate()`
batches as the benchmarks' baseline runs them. Printed and written to --json: images/s, generated
tokens/s, peak GPU memory, the model's own memory, and at batch 32 the fraction of the derived
roofline (~20-26 images/s on one H200: docs/benchmarks.md). The engine on a realistic mix is
tests/bench/bench_engine_mix.py; the structured-answer mask, tests/bench/bench_grammar_vocab.py.

    python tests/bench/bench_gpu.py [--modes bf16,nf4] [--batches 1,8,32] [--repeats 1] [--json F]
    python tests/bench/bench_gpu.py --smoke      # the tiny Fuyu's shape on the CPU: proves the script
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after sys.path is set

from tests.bench import random_fuyu  # noqa: E402 - after sys.path is set
from workers.backends.base import GenerationInput  # noqa: E402 - after sys.path is set

ROOFLINE_B32 = (20.0, 26.0)  # images/s, H200, batch 32, 1024^2, 64 + 64 tokens (derived, not measured)
GIB = 2**30


def prompt_of(backend: Any, tokens: int) -> str:
    words = "can I get a refund for this damaged parcel please " * 40
    ids = backend.processor.tokenizer(words, add_special_tokens=False)["input_ids"][:tokens]
    return str(backend.processor.tokenizer.decode(ids))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def batch_row(backend: Any, batch: int, side: int, prompt: str, new: int, repeats: int) -> dict[str, Any]:
    """images/s of static generate() batches of `batch` identical-shape jobs (one warm-up first)."""
    device = backend.device
    image = torch.randint(
        0, 256, (3, side, side), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    items = [GenerationInput(image, prompt, new, exact_steps=True) for _ in range(batch)]
    backend.generate(items)  # warm this shape (kernels, autotuning, the allocator's blocks)
    _sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    tokens = sum(out.output_tokens for _ in range(repeats) for out in backend.generate(items))
    _sync(device)
    seconds = time.perf_counter() - began
    row: dict[str, Any] = {
        "batch": batch,
        "images_per_s": round(batch * repeats / seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "tokens_per_image": tokens / (batch * repeats),
        "seconds_per_batch": round(seconds / repeats, 4),
    }
    if device.startswith("cuda"):
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    if batch == 32:
        rate = row["images_per_s"]
        row["roofline_fraction"] = [round(rate / ROOFLINE_B32[1], 3), round(rate / ROOFLINE_B32[0], 3)]
    return row


def run_mode(backend: Any, args: argparse.Namespace, figures: dict[str, Any], save: Any) -> None:
    began = time.perf_counter()
    kernel = random_fuyu.warm_up(backend)
    mode: dict[str, Any] = {
        "mode": backend.quantization,
        "load_s": figures.pop("_load_s"),
        "warm_up_s": round(time.perf_counter() - began, 2),
        "model_gib": round(backend.model.get_memory_footprint() / GIB, 3),
        # proof that NF4 really is 4-bit: the linear layers bitsandbytes replaced
        "linear_4bit_layers": sum(type(m).__name__ == "Linear4bit" for m in backend.model.modules()),
        "attention": backend.describe(),
        "attention_kernel_prefill": kernel,
        "load_error": backend.load_error,
        "batches": [],
    }
    figures["modes"].append(mode)
    print(f"[{mode['mode']}] model {mode['model_gib']} GiB, attention {mode['attention']}", flush=True)
    prompt = prompt_of(backend, args.prompt_tokens)
    for batch in args.batches:
        row = batch_row(backend, batch, args.side, prompt, args.new_tokens, args.repeats)
        mode["batches"].append(row)
        save()
        print(f"[{mode['mode']}] {json.dumps(row)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="bf16,nf4", help="bf16 first: NF4 is quantized from its weights")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=1, help="timed batches after the warm-up one")
    parser.add_argument("--side", type=int, default=1024, help="image side (square images)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write every figure here (after each row)")
    parser.add_argument("--smoke", "--tiny", action="store_true", help="tiny shape, tiny sizes, on the CPU")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.side, args.prompt_tokens, args.new_tokens = "1,2", 60, 8, 4
    args.batches = [int(b) for b in args.batches.split(",")]
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs CUDA (or --smoke, on the CPU)")
    figures: dict[str, Any] = {"device": device, "shape": "tiny" if args.smoke else "fuyu-8b", "modes": []}
    if device == "cuda":
        figures["gpu"] = torch.cuda.get_device_name(0)

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2, default=str))

    began = time.perf_counter()
    source = random_fuyu.build(random_fuyu.config_of(figures["shape"]), device, torch.bfloat16)
    figures["build_s"] = round(time.perf_counter() - began, 2)
    print(f"random {figures['shape']} weights built on {device} in {figures['build_s']} s", flush=True)
    modes = sorted(args.modes.split(","), key=lambda m: m != "bf16")  # bf16 first: NF4 is made from it
    if not run_modes(modes, source, device, args, figures, save):
        raise SystemExit(1)


def run_modes(
    modes: list[str], source: Any, device: str, args: Any, figures: dict[str, Any], save: Any
) -> bool:
    """Each mode in turn; False when one failed (its error is in the figures, the others' still come)."""
    held: list[Any] = []  # backends alive: the bf16 one until NF4 has its own weights
    ok = True
    for mode in modes:
        try:
            began = time.perf_counter()
            backend = random_fuyu.backend(source, mode, device)
            figures["_load_s"] = round(time.perf_counter() - began, 2)
            if mode != "bf16":  # its own weights now: free the bf16 ones so its peak memory is its own
                release(held)
                held, backend.source_model, source = [], None, None
                random_fuyu.free(device)
            held.append(backend)
            run_mode(backend, args, figures, save)
        except Exception as exc:  # one mode's failure (bitsandbytes' CUDA library, say) keeps the other's
            ok = False
            traceback.print_exc()
            figures["modes"].append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:500]})
        save()
    release(held)
    return ok


def release(backends: list[Any]) -> None:
    for backend in backends:
        backend.close()
        backend.model = backend.source_model = None


if __name__ == "__main__":
    main()
