"""Our device-side preprocessing against FuyuProcessor, from the same bytes.

Guards against the classic fault where a faster resize silently changes colours or sharpness: the
token ids must be identical and the pixel values within TOLERANCE (raw 0-255 units). On the CPU the
two paths are bit-exact (same decoder, same torchvision resize); the tolerance is for the CUDA path
(nvjpeg, GPU resize kernels), checked by tests/gpu.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from tests.support import imagegen
from workers import images
from workers.backends import fuyu_geometry
from workers.backends import fuyu_preprocess as preprocess
from workers.backends.tiny import ensure_tiny_model

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")
TOLERANCE = {"mean": 1.0, "max": 8.0}  # in 0-255 pixel units
CASES = [
    (4000, 3000, "JPEG"),
    (3024, 4032, "JPEG"),
    (1920, 1080, "PNG"),
    (1921, 1081, "JPEG"),
    (400, 300, "PNG"),
    (640, 480, "WEBP"),
    (31, 29, "PNG"),
    (1, 1, "PNG"),
    (5000, 40, "JPEG"),
]


@pytest.fixture(scope="module")
def processor() -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(ensure_tiny_model(HOME), local_files_only=True)


def _ids(processor: Any) -> preprocess.TokenIds:
    tok = processor.tokenizer
    return preprocess.TokenIds(
        image=tok.convert_tokens_to_ids("|SPEAKER|"),
        newline=tok.convert_tokens_to_ids("|NEWLINE|"),
        bos=tok.convert_tokens_to_ids("<s>"),
        pad=0,
    )


def _reference(processor: Any, datas: list[bytes], prompts: list[str]) -> Any:
    pils = [ImageOps.exif_transpose(Image.open(io.BytesIO(d))).convert("RGB") for d in datas]
    return processor(text=prompts, images=pils, return_tensors="pt", return_legacy_image_output=False)


def _ours(processor: Any, datas: list[bytes], prompts: list[str]) -> dict[str, torch.Tensor]:
    tensors = [images.load(d, 10**9).tensor for d in datas]
    prompt_ids = [processor.tokenizer(p + "<0x04>", add_special_tokens=False)["input_ids"] for p in prompts]
    return preprocess.build_inputs(tensors, prompt_ids, _ids(processor), torch.float32, "cpu")


def _compare(ref: Any, ours: dict[str, torch.Tensor]) -> dict[str, float]:
    assert torch.equal(ref["input_ids"], ours["input_ids"])
    assert torch.equal(ref["attention_mask"], ours["attention_mask"])
    assert ref["pixel_values"].shape == ours["pixel_values"].shape
    diff = (ref["pixel_values"] - ours["pixel_values"]).abs() * 127.5
    return {"mean": float(diff.mean()), "max": float(diff.max())}


@pytest.mark.parametrize(("width", "height", "fmt"), CASES)
def test_single_image_inputs_equal_the_processor(processor: Any, width: int, height: int, fmt: str) -> None:
    data = imagegen.photo(width, height, seed=width % 7, fmt=fmt)
    diff = _compare(
        _reference(processor, [data], ["Can I get a refund?"]),
        _ours(processor, [data], ["Can I get a refund?"]),
    )
    assert diff["mean"] <= TOLERANCE["mean"], diff
    assert diff["max"] <= TOLERANCE["max"], diff


def test_mixed_batch_equals_the_processor(processor: Any) -> None:
    datas = [imagegen.photo(w, h, seed=i, fmt=f) for i, (w, h, f) in enumerate(CASES[:6])]
    prompts = ["what is this?", "这个包裹坏了吗？", "refund | now", "a", "b c d e f g", "😀"]
    diff = _compare(_reference(processor, datas, prompts), _ours(processor, datas, prompts))
    assert diff["mean"] <= TOLERANCE["mean"], diff
    assert diff["max"] <= TOLERANCE["max"], diff


@pytest.mark.parametrize("max_side", [0, 480])
def test_patches_made_once_per_photo_are_the_inputs_made_per_row(processor: Any, max_side: int) -> None:
    """A photo's patches made in the decode threads and kept for its next question (`pixels_of`) give
    the very inputs `build_inputs` makes from the image, alone and beside images made per row; and
    one row uses them as they are (its pixel_values are the kept tensor: no copy)."""
    tensors = [
        images.load(imagegen.photo(w, h, seed=i, fmt=f), 10**9).tensor
        for i, (w, h, f) in enumerate(CASES[:4])
    ]
    prompt_ids = [
        processor.tokenizer(f"question {i}?<0x04>", add_special_tokens=False)["input_ids"] for i in range(4)
    ]
    ids, made = _ids(processor), [preprocess.pixels_of(t, torch.float32, max_side) for t in tensors]
    fresh = preprocess.build_inputs(tensors, prompt_ids, ids, torch.float32, "cpu", max_side)
    mixed = [made[0], None, made[2], None]
    for kept in (made, mixed):
        again = preprocess.build_inputs(tensors, prompt_ids, ids, torch.float32, "cpu", max_side, made=kept)
        assert all(torch.equal(fresh[name], again[name]) for name in fresh), kept
    one = preprocess.build_inputs(
        tensors[:1], prompt_ids[:1], ids, torch.float32, "cpu", max_side, made=made[:1]
    )
    alone = preprocess.build_inputs(tensors[:1], prompt_ids[:1], ids, torch.float32, "cpu", max_side)
    assert all(torch.equal(alone[name], one[name]) for name in alone)
    assert one["pixel_values"] is made[0].values


@pytest.mark.parametrize(("height", "width"), [(1080, 1440), (960, 1280), (3024, 4032), (29, 31), (1, 1)])
def test_patches_are_the_same_from_either_layout(height: int, width: int) -> None:
    """Pixels laid out pixel by pixel (a decoded photo) or plane by plane (a tensor made elsewhere) give
    the same patches, fitted or not, padded to the grid or not, in every dtype the worker uses."""
    generator = torch.Generator().manual_seed(height * width)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
    by_pixel, by_plane = pixels.permute(2, 0, 1), pixels.permute(2, 0, 1).contiguous()
    assert not by_pixel.is_contiguous() or height * width == 1
    for dtype in (torch.float32, torch.bfloat16):
        for max_side in (0, 480):
            one = preprocess.pixels_of(by_pixel, dtype, max_side)
            other = preprocess.pixels_of(by_plane, dtype, max_side)
            assert (one.rows, one.cols) == (other.rows, other.cols)
            assert torch.equal(one.values, other.values), (dtype, max_side)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_patches_in_the_models_dtype_are_the_processors_values_rounded_once(dtype: torch.dtype) -> None:
    """Patches are widened into the model's dtype and normalised there: each of the 256 byte values
    (padding included) must be exactly what the processor's fused float32 normalisation gives (x -
    127.5) / 127.5, then cast to that dtype, written into a batch's slice or made alone."""
    values = torch.arange(256, dtype=torch.uint8).repeat(3 * 30 * 31)[: 3 * 59 * 61]
    photo = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(7))]
    photo = photo.view(59, 61, 3).permute(2, 0, 1)  # pads to a 2x3 grid of patches
    padded = torch.full((3, 60, 90), preprocess.PAD_VALUE, dtype=torch.uint8)
    padded[:, :59, :61] = photo
    grid = padded.view(3, 2, 30, 3, 30).permute(1, 3, 2, 4, 0).reshape(6, 2700)
    expected = grid.to(torch.float32).sub(127.5).div(127.5).to(dtype)
    alone = preprocess.patchify(photo, dtype)
    batch = torch.full((8, 2700), 9.0, dtype=dtype)
    written = preprocess.patchify(photo, dtype, out=batch[1:7])
    assert alone.dtype == dtype
    assert torch.equal(alone, expected)
    assert written.data_ptr() == batch[1:7].data_ptr()
    assert torch.equal(batch[1:7], expected)
    assert torch.equal(batch[0], torch.full((2700,), 9.0, dtype=dtype))  # its neighbours untouched
    assert set(torch.unique(grid).tolist()) == set(range(256))


def test_exif_rotated_photo_equals_the_processor(processor: Any) -> None:
    img = Image.open(io.BytesIO(imagegen.photo(320, 200)))
    exif = Image.Exif()
    exif[0x0112] = 8
    out = io.BytesIO()
    img.save(out, format="JPEG", exif=exif.tobytes())
    diff = _compare(_reference(processor, [out.getvalue()], ["q"]), _ours(processor, [out.getvalue()], ["q"]))
    assert diff["max"] <= TOLERANCE["max"]


def test_tiny_model_generates_the_same_tokens_from_both(processor: Any) -> None:
    from transformers import FuyuForCausalLM

    model = FuyuForCausalLM.from_pretrained(ensure_tiny_model(HOME), local_files_only=True).eval()
    datas = [imagegen.photo(w, h, seed=i, fmt=f) for i, (w, h, f) in enumerate(CASES[2:6])]
    prompts = ["what is written here?", "退款", "is it broken", "colour?"]
    outs = []
    for inputs in (_reference(processor, datas, prompts), _ours(processor, datas, prompts)):
        with torch.inference_mode():
            outs.append(model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist())
    assert outs[0] == outs[1]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20000), st.integers(1, 20000), st.sampled_from([0, 0, 224, 512, 1000]))
def test_fit_size_shrinks_only_and_keeps_the_aspect(height: int, width: int, max_side: int) -> None:
    h, w = fuyu_geometry.fit_size(height, width, max_side)
    limit_h, limit_w = (min(1080, max_side), min(1920, max_side)) if max_side else (1080, 1920)
    assert 1 <= h <= max(limit_h, 1)
    assert 1 <= w <= max(limit_w, 1)
    if height <= limit_h and width <= limit_w:
        assert (h, w) == (height, width)
    else:
        assert h <= height
        assert w <= width
        # One side reaches its limit, give or take the processor's float truncation (999.99... -> 999).
        assert h >= limit_h - 1 or w >= limit_w - 1 or min(h, w) == 1
        if min(h, w) > 1:  # int() truncation moves each side by under one pixel
            assert abs(h / w - height / width) <= height / width * (1 / h + 1 / w) * 1.01


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 700), st.integers(1, 700))
def test_token_count_matches_the_built_inputs(height: int, width: int) -> None:
    ids = preprocess.TokenIds(image=5, newline=6, bos=2, pad=0)
    built = preprocess.build_inputs(
        [torch.zeros((3, height, width), dtype=torch.uint8)], [[7]], ids, torch.float32, "cpu"
    )
    row = built["input_ids"][0].tolist()
    assert row.count(5) + row.count(6) == fuyu_geometry.image_token_count(height, width)
    assert built["pixel_values"].shape[0] == row.count(5)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6000), st.integers(1, 6000))
def test_token_count_matches_the_processors_formula(processor: Any, height: int, width: int) -> None:
    scale = min(1.0, 1080 / height, 1920 / width)
    assume(int(height * scale) >= 1 and int(width * scale) >= 1)  # the processor fails on 0-pixel sides
    expected = processor._get_num_multimodal_tokens(image_sizes=[[height, width]]).num_image_tokens[0]
    assert fuyu_geometry.image_token_count(height, width) == expected


def test_sixteen_bit_png_is_scaled_not_clipped() -> None:
    out = io.BytesIO()
    Image.fromarray(np.full((8, 8), 32768, dtype=np.uint16)).save(out, format="PNG")
    assert images.load(out.getvalue(), 10**6).tensor.unique().tolist() == [128]


def test_side_cap_cuts_image_tokens() -> None:
    ids = preprocess.TokenIds(image=5, newline=6, bos=2, pad=0)
    image = torch.zeros((3, 3000, 4000), dtype=torch.uint8)
    full = preprocess.build_inputs([image], [[7]], ids, torch.float32, "cpu")
    capped = preprocess.build_inputs([image], [[7]], ids, torch.float32, "cpu", max_side=480)
    assert full["pixel_values"].shape[0] == 36 * 48
    assert capped["pixel_values"].shape[0] == 12 * 16  # 360x480 after the cap
    assert fuyu_geometry.image_token_count(3000, 4000, 480) == 12 * 17
