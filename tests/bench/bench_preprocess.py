"""Preprocessing throughput: our path (the worker's decoders + workers/backends/fuyu_preprocess.py on
MRC_DEVICE) against the naive one (PIL decode + FuyuProcessor on the CPU), from image bytes to model
inputs, same images, same run. Prints images/s for both and the ratio at batch 1 and 16.

Per kind (12 MP phone photos, full-HD screenshots, small uploads): ms per image at batch 1 and 16, and
the largest difference from the processor's pixel values (what a CUDA resize may change).

    .venv/bin/python tests/bench/bench_preprocess.py [--device cpu|cuda] [--passes 3] [--json F]
    .venv/bin/python tests/bench/bench_preprocess.py --quick     # small images, one pass
"""

from __future__ import annotations

import argparse
import io
import json
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
from workers import images  # noqa: E402 - after sys.path is set
from workers.backends import fuyu_preprocess as preprocess  # noqa: E402 - after sys.path is set
from workers.backends.tiny import ensure_tiny_model  # noqa: E402 - after sys.path is set

PROMPT = "The parcel arrived crushed. Can I get a refund?"


# (kind, width, height, format): 12 MP phone photos (both orientations), full-HD screenshots, small uploads.
KINDS = (
    ("photo 12MP", ((4000, 3000, "JPEG"), (3024, 4032, "JPEG"))),
    ("screenshot 1920x1080", ((1920, 1080, "PNG"),)),
    ("small 400x300", ((400, 300, "PNG"),)),
)
QUICK_KINDS = (
    ("photo 12MP (quick: 800x600)", ((800, 600, "JPEG"), (600, 800, "JPEG"))),
    ("screenshot 1920x1080 (quick: 640x360)", ((640, 360, "PNG"),)),
    ("small 400x300 (quick: 100x75)", ((100, 75, "PNG"),)),
)


def _make(width: int, height: int, fmt: str, seed: int) -> bytes:
    if fmt == "JPEG":
        return imagegen.camera_photo(width, height, seed=seed)
    if width >= 640:
        return imagegen.screenshot(width, height, seed=seed)
    return imagegen.photo(width, height, seed=seed, fmt=fmt)


def image_set(quick: bool = False, per_kind: int = 4) -> list[tuple[str, bytes]]:
    """`per_kind` images of each kind (12 MP phone photos, full-HD screenshots, small uploads)."""
    out = []
    for kind, sizes in QUICK_KINDS if quick else KINDS:
        for i in range(per_kind):
            width, height, fmt = sizes[i % len(sizes)]
            out.append((kind, _make(width, height, fmt, seed=10 * len(out) + i)))
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


def ours(
    tokenizer: Any,
    ids: preprocess.TokenIds,
    datas: list[bytes],
    device: str,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    # As the worker does it: decodes in a thread pool (torchvision releases the GIL), then one device pass.
    tensors = [t for t in POOL.map(lambda d: _decode(d, device), datas)]
    prompt_ids = [tokenizer(PROMPT + "<0x04>", add_special_tokens=False)["input_ids"]] * len(datas)
    inputs = preprocess.build_inputs(tensors, prompt_ids, ids, dtype, device)
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


def parity(processor: Any, tok: Any, ids: preprocess.TokenIds, datas: list[bytes], device: str) -> dict:
    """Ours on `device` against the processor on the CPU, one image at a time: the largest and the mean
    absolute difference of the pixel values in 0-255 units, and whether the token ids are equal."""
    worst, means, same_ids = 0.0, [], True
    for data in datas:
        ref, mine = naive(processor, [data]), ours(tok, ids, [data], device, torch.float32)
        same_ids &= bool(torch.equal(ref["input_ids"], mine["input_ids"].cpu()))
        if ref["pixel_values"].shape != mine["pixel_values"].shape:
            return {"same_shape": False, "same_ids": same_ids}
        diff = (ref["pixel_values"].float() - mine["pixel_values"].float().cpu()).abs() * 127.5
        worst, means = max(worst, float(diff.max())), [*means, float(diff.mean())]
    return {
        "same_shape": True,
        "same_ids": same_ids,
        "max_abs": round(worst, 3),
        "mean_abs": round(max(means), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=os.environ.get("MRC_DEVICE", "cpu").replace("auto", "cpu"))
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small images, one pass (a smoke test)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--per-kind", type=int, default=4, help="distinct images of each kind (cycled)")
    parser.add_argument("--no-mixed", action="store_true", help="only the per-kind figures")
    args = parser.parse_args()
    batches = (1, 4) if args.quick else (1, 16)
    if args.quick:
        args.passes = 1
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
    named = image_set(args.quick, args.per_kind)
    datas = [d for _, d in named]
    mb = sum(len(d) for d in datas) / 1e6
    print(f"images: {len(datas)} ({mb:.1f} MB encoded): " + ", ".join(sorted({n for n, _ in named})))
    print(f"torch threads: {torch.get_num_threads()}, ours on: {args.device}, processor on: cpu")
    print(f"{'batch':>5} | {'FuyuProcessor img/s':>20} | {'ours img/s':>10} | {'ours / processor':>16}")
    figures: dict[str, Any] = {"device": args.device, "quick": args.quick, "mixed": [], "kinds": {}}
    for batch in () if args.no_mixed else batches:
        base = rate(lambda d: naive(processor, d), datas, batch, args.passes)
        mine = rate(lambda d: ours(tok, ids, d, args.device), datas, batch, args.passes)
        print(f"{batch:>5} | {base:>20.2f} | {mine:>10.2f} | {mine / base:>15.2f}x")
        figures["mixed"].append({"batch": batch, "processor_img_s": base, "ours_img_s": mine})
    print("\nper kind (ms/image): batch, processor, ours, ratio; parity with the processor (0-255 units)")
    for kind in dict.fromkeys(n for n, _ in named):
        subset = [d for n, d in named if n == kind]
        row: dict[str, Any] = {"parity": parity(processor, tok, ids, subset, args.device)}
        for batch in batches:
            cycled = (subset * (batch // len(subset) + 1))[: max(batch, len(subset))]
            base = 1000 / rate(lambda d: naive(processor, d), cycled, batch, args.passes)
            mine = 1000 / rate(lambda d: ours(tok, ids, d, args.device), cycled, batch, args.passes)
            row[f"batch_{batch}"] = {"processor_ms": round(base, 2), "ours_ms": round(mine, 2)}
            print(f"  {kind:<38} {batch:>3} {base:9.2f} {mine:9.2f} {base / mine:7.2f}x")
        print(f"  {kind:<38} parity {row['parity']}")
        figures["kinds"][kind] = row
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
