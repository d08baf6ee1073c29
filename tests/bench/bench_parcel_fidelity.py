"""Preprocessing fidelity, measured as accuracy: the parcels model answers the same held-out photos
through four preprocessing paths, and each path's accuracy per question is printed side by side.

  mrc        workers/images.py decode + workers/backends/fuyu_preprocess.py (the worker's device path)
  reference  PIL decode + FuyuProcessor (transformers' own CPU path)
  blur       a naive GPU-style path: a Gaussian blur before a plain bilinear resize, as kornia's
             `resize(..., antialias=True)` does (implemented here in torch: kornia is not a dependency)
  bilinear   a plain bilinear resize, no antialiasing (torch's F.interpolate default)

The world's photos (scripts/parcels.py) are at most 1024 x 768 and Fuyu only ever shrinks, so as drawn
no path resizes anything (mrc and the processor are bit-exact there: tests/unit/test_preprocess_parity.py).
Here every scene is drawn as in the world, upscaled 2.5x (LANCZOS) and saved as a JPEG (quality 92),
like a phone photo of it; each path then shrinks it back to fit 750 x 750 (`MRC_MAX_IMAGE_SIDE=750`
on the mrc path, the processor's size set to 750 x 750: it takes multiples of 30), which lands it
inside the world again.

    .venv/bin/python tests/bench/bench_parcel_fidelity.py [--images 200] [--factor 2.5]
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after sys.path is set
import torch.nn.functional as F  # noqa: E402 - after sys.path is set
from PIL import Image  # noqa: E402 - after sys.path is set

from scripts import parcels  # noqa: E402 - after sys.path is set
from workers import images  # noqa: E402 - after sys.path is set
from workers.backends import fuyu_geometry  # noqa: E402 - after sys.path is set
from workers.backends import fuyu_preprocess as preprocess  # noqa: E402 - after sys.path is set
from workers.models import parcels_path  # noqa: E402 - after sys.path is set

SEED = 960_000_000  # held out: below the training's seeds, apart from the accuracy test's
PATHS = ("reference", "mrc", "blur", "bilinear")  # the reference first: the others are compared to it


def photo(seed: int, factor: float) -> tuple[bytes, parcels.Parcel]:
    """A world scene as a high-resolution JPEG, `factor` times its drawn size."""
    data, truth = parcels.make(seed)
    scene = Image.open(io.BytesIO(data)).convert("RGB")
    big = scene.resize((round(truth.width * factor), round(truth.height * factor)), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    big.save(out, format="JPEG", quality=92)
    return out.getvalue(), truth


def _kernel(sigma: float, size: int) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    weights = torch.exp(-(x**2) / (2 * sigma**2))
    return weights / weights.sum()


def naive_resize(image: torch.Tensor, height: int, width: int, blur: bool) -> torch.Tensor:
    """uint8 CHW -> uint8 CHW at (height, width): kornia's antialias (a Gaussian of sigma (factor-1)/2,
    kernel 4 sigma rounded up to odd and at least 3, reflect borders), then bilinear."""
    x = image.float().unsqueeze(0)
    if blur:
        for axis, factor in ((2, image.shape[1] / height), (3, image.shape[2] / width)):
            sigma = max((factor - 1.0) / 2.0, 0.001)
            size = int(max(2.0 * 2 * sigma, 3))
            size += 1 - size % 2
            k = (
                _kernel(sigma, size).view(1, 1, -1, 1)
                if axis == 2
                else _kernel(sigma, size).view(1, 1, 1, -1)
            )
            pad = (0, 0, size // 2, size // 2) if axis == 2 else (size // 2, size // 2, 0, 0)
            x = F.conv2d(F.pad(x, pad, mode="reflect"), k.repeat(3, 1, 1, 1), groups=3)
    x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8)[0]


class Paths:
    """Model inputs for one photo and its three questions, by each path."""

    def __init__(self, processor: Any, side: int) -> None:
        self.processor = processor
        self.side = side
        tok = processor.tokenizer
        self.ids = preprocess.TokenIds(
            image=tok.convert_tokens_to_ids("|SPEAKER|"),
            newline=tok.convert_tokens_to_ids("|NEWLINE|"),
            bos=tok.convert_tokens_to_ids("<s>"),
            pad=0,
        )
        self.answer_id = tok.convert_tokens_to_ids("<0x04>")

    def inputs(self, path: str, data: bytes, prompts: list[str]) -> dict[str, Any]:
        if path == "reference":
            image = Image.open(io.BytesIO(data)).convert("RGB")
            return dict(
                self.processor(
                    text=prompts,
                    images=[image] * len(prompts),
                    return_tensors="pt",
                    return_legacy_image_output=False,
                )
            )
        tensor = images.load(data, 10**9).tensor
        if path in ("blur", "bilinear"):
            height, width = fuyu_geometry.fit_size(tensor.shape[1], tensor.shape[2], self.side)
            tensor = naive_resize(tensor, height, width, blur=path == "blur")
        tok = self.processor.tokenizer
        prompt_ids = [[*tok(p, add_special_tokens=False)["input_ids"], self.answer_id] for p in prompts]
        return preprocess.build_inputs(
            [tensor] * len(prompts), prompt_ids, self.ids, torch.float32, "cpu", self.side
        )


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from transformers import AutoProcessor, FuyuForCausalLM

    folder = parcels_path()
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    processor.image_processor.size = {"height": args.side, "width": args.side}
    model = FuyuForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    paths = Paths(processor, args.side)
    right = {p: dict.fromkeys(parcels.KINDS, 0) for p in PATHS}
    differences = {p: 0.0 for p in PATHS}
    for i in range(args.images):
        data, truth = photo(SEED + i, args.factor)
        prompts = [parcels.question(SEED + i, kind) for kind in parcels.KINDS]
        reference_pixels = None
        for path in PATHS:
            inputs = paths.inputs(path, data, prompts)
            if path == "reference":
                reference_pixels = inputs["pixel_values"]
            elif reference_pixels is not None:
                differences[path] += float((inputs["pixel_values"] - reference_pixels).abs().mean()) * 127.5
            with torch.inference_mode():
                out = model.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=0)
            answers = processor.tokenizer.batch_decode(
                out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
            )
            for kind, answer in zip(parcels.KINDS, answers, strict=True):
                right[path][kind] += parcels.is_right(kind, answer, truth)
        if (i + 1) % 50 == 0:
            print(f"{i + 1} photos", flush=True)
    table = {p: {k: v / args.images for k, v in right[p].items()} for p in PATHS}
    for p in PATHS:
        table[p]["pixels"] = differences[p] / args.images
    return table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument(
        "--factor", type=float, default=2.5, help="how much larger the photo is than the scene"
    )
    parser.add_argument(
        "--side", type=int, default=750, help="the box every path shrinks into (a multiple of 30)"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    table = measure(args)
    print(f"\n{args.images} held-out scenes as {args.factor}x photos (JPEG q92), shrunk to fit {args.side}:")
    print("| path | colour | damage | digit | mean abs pixel difference from reference (0-255) |")
    print("|---|---|---|---|---|")
    for path, row in table.items():
        pixels = "-" if path == "reference" else f"{row['pixels']:.2f}"
        print(f"| {path} | {row['colour']:.1%} | {row['damage']:.1%} | {row['digit']:.1%} | {pixels} |")


if __name__ == "__main__":
    main()
