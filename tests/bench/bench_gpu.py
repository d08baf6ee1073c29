"""GPU only: a randomly initialised Fuyu-8B-sized model (the real config, no weights needed), NF4 and bf16,
loaded through mrc's own loader (workers/backends/fuyu.py); batches of 1, 8 and 32 images of 1024x1024 with
64-token prompts and 64 new tokens. Prints images/s, peak GPU memory and the fraction of the roofline
(~20-26 images/s at batch 32 on an H200, STACK-NOTES.md).

    MRC_DEVICE=cuda .venv/bin/python tests/bench/bench_gpu.py [--modes nf4,bf16] [--batches 1,8,32]
    .venv/bin/python tests/bench/bench_gpu.py --tiny     # smoke test of the script itself, on the CPU
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after sys.path is set

from shared.settings import Settings  # noqa: E402 - after sys.path is set
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


def run_mode(folder: Path, mode: str, batches: list[int], device: str, repeats: int) -> None:
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
    for batch in batches:
        items = [GenerationInput(image, prompt, 64) for _ in range(batch)]
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        backend.generate(items)  # warm this shape
        began = time.perf_counter()
        for _ in range(repeats):
            backend.generate(items)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        rate = batch * repeats / (time.perf_counter() - began)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")
        line = f"[{mode}] batch {batch:>2}: {rate:7.2f} images/s, peak GPU memory {peak:6.1f} GiB"
        if batch == 32:
            line += f", roofline fraction {rate / ROOFLINE_B32[1]:.2f}-{rate / ROOFLINE_B32[0]:.2f}"
        print(line, flush=True)
    del backend
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description="Fuyu-8B-sized throughput on one GPU")
    parser.add_argument("--modes", default="nf4,bf16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="smoke-test the script on the tiny config (CPU)")
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
        for mode in args.modes.split(","):
            run_mode(folder, mode, [int(b) for b in args.batches.split(",")], device, args.repeats)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
