"""Preprocessing throughput: our path (torchvision decode + workers/preprocess.py on MRC_DEVICE) against
the naive one (PIL decode + FuyuProcessor on the CPU), from image bytes to model inputs, same images,
same run. Prints images/s for both and the ratio at batch 1 and 16.

    .venv/bin/python tests/bench/bench_preprocess.py [--device cpu|cuda] [--passes 3]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after sys.path is set
from PIL import Image, ImageOps  # noqa: E402 - after sys.path is set

from tests.support import imagegen  # noqa: E402 - after sys.path is set
from workers import images, preprocess  # noqa: E402 - after sys.path is set
from workers.backends.tiny import ensure_tiny_model  # noqa: E402 - after sys.path is set

PROMPT = "The parcel arrived crushed. Can I get a refund?"


def image_set() -> list[tuple[str, bytes]]:
    """16 images: phone photos (4000x3000, 3024x4032), 1920x1080 screenshots, small PNGs."""
    out = []
    for i in range(4):
        out.append(("photo 4000x3000 jpg", imagegen.camera_photo(4000, 3000, seed=i)))
        out.append(("photo 3024x4032 jpg", imagegen.camera_photo(3024, 4032, seed=10 + i)))
        out.append(("screenshot 1920x1080 png", imagegen.screenshot(1920, 1080, seed=i)))
        out.append(("small 400x300 png", imagegen.photo(400, 300, seed=20 + i, fmt="PNG")))
    return out


def naive(processor: Any, datas: list[bytes]) -> Any:
    pils = [ImageOps.exif_transpose(Image.open(io.BytesIO(d))).convert("RGB") for d in datas]
    return processor(
        text=[PROMPT] * len(datas), images=pils, return_tensors="pt", return_legacy_image_output=False
    )


# As in the worker: MRC_FETCH_THREADS threads, one OpenMP thread each.
POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="decode", initializer=images.init_decode_thread)


def _decode(data: bytes, device: str) -> torch.Tensor:
    """What the worker's pool does per image: decode and, on the CPU, shrink to fit right away."""
    tensor = images.load(data, 10**9, device).tensor
    return preprocess.resize_to_fit(tensor) if device == "cpu" else tensor


def ours(tokenizer: Any, ids: preprocess.TokenIds, datas: list[bytes], device: str) -> Any:
    # As the worker does it: decodes in a thread pool (torchvision releases the GIL), then one device pass.
    tensors = [t for t in POOL.map(lambda d: _decode(d, device), datas)]
    prompt_ids = [tokenizer(PROMPT + "<0x04>", add_special_tokens=False)["input_ids"]] * len(datas)
    inputs = preprocess.build_inputs(tensors, prompt_ids, ids, torch.bfloat16, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return inputs


def rate(fn: Any, datas: list[bytes], batch: int, passes: int) -> float:
    """Images per second: the median over passes of one sweep through the set in `batch`-sized calls."""
    fn(datas[:batch])  # warm-up (lazy initialisation, CUDA context, caches)
    results = []
    for _ in range(passes):
        began = time.perf_counter()
        for start in range(0, len(datas), batch):
            fn(datas[start : start + batch])
        results.append(len(datas) / (time.perf_counter() - began))
    return statistics.median(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=os.environ.get("MRC_DEVICE", "cpu").replace("auto", "cpu"))
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(
        ensure_tiny_model(str(ROOT / ".cache" / "mrc")), local_files_only=True
    )
    tok = processor.tokenizer
    ids = preprocess.TokenIds(
        tok.convert_tokens_to_ids("|SPEAKER|"),
        tok.convert_tokens_to_ids("|NEWLINE|"),
        tok.convert_tokens_to_ids("<s>"),
        0,
    )
    named = image_set()
    datas = [d for _, d in named]
    mb = sum(len(d) for d in datas) / 1e6
    print(f"images: {len(datas)} ({mb:.1f} MB encoded): " + ", ".join(sorted({n for n, _ in named})))
    print(f"torch threads: {torch.get_num_threads()}, ours on: {args.device}, processor on: cpu")
    print(f"{'batch':>5} | {'FuyuProcessor img/s':>20} | {'ours img/s':>10} | {'ours / processor':>16}")
    for batch in (1, 16):
        base = rate(lambda d: naive(processor, d), datas, batch, args.passes)
        mine = rate(lambda d: ours(tok, ids, d, args.device), datas, batch, args.passes)
        print(f"{batch:>5} | {base:>20.2f} | {mine:>10.2f} | {mine / base:>15.2f}x")
    print("\nper kind, batch 4 (img/s): processor / ours / ratio")
    for kind in sorted({n for n, _ in named}):
        subset = [d for n, d in named if n == kind]
        base = rate(lambda d: naive(processor, d), subset, 4, args.passes)
        mine = rate(lambda d: ours(tok, ids, d, args.device), subset, 4, args.passes)
        print(f"  {kind:<26} {base:8.2f} {mine:8.2f} {mine / base:8.2f}x")


if __name__ == "__main__":
    main()
