"""The real loader on the tiny Fuyu, on the CPU: NF4 and the unquantized modes through the same code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.errors import ModelError, PromptTooLong
from shared.settings import Settings
from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend
from workers.backends.fuyu_geometry import fit_size, image_token_count

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")


@pytest.fixture(scope="module", params=["nf4", "fp32"])
def backend(request: pytest.FixtureRequest) -> FuyuBackend:
    b = FuyuBackend(Settings(model="tiny", home=HOME, quantization=request.param, device="cpu"))
    b.load()
    return b


def _image(height: int, width: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _inputs() -> list[GenerationInput]:
    return [
        GenerationInput(_image(60, 90, 1), "what colour is this?", 6),
        GenerationInput(_image(300, 400, 2), "这个包裹坏了吗？", 3),
        GenerationInput(_image(1000, 2000, 3), "is it broken", 5),
    ]


def test_batched_outputs_equal_one_at_a_time(backend: FuyuBackend) -> None:
    batch = backend.generate(_inputs())
    alone = [backend.generate([item])[0] for item in _inputs()]
    assert batch == alone
    assert [o.output_tokens <= i.max_new_tokens for o, i in zip(batch, _inputs(), strict=True)] == [True] * 3


def test_describe_names_what_runs(backend: FuyuBackend) -> None:
    info = backend.describe()
    assert info["model"] == "tiny-fuyu-v1"
    assert info["device"] == "cpu"
    assert info["quantization"] in ("nf4", "fp32")
    assert info["attention_backend"]


def test_prompt_planning(backend: FuyuBackend) -> None:
    plan = backend.plan_prompt("one two three " * 50, 10, truncate=True)
    assert plan.truncated
    assert plan.tokens == 10
    assert plan.original_tokens > 10
    with pytest.raises(PromptTooLong):
        backend.plan_prompt("one two three " * 50, 10, truncate=False)


def test_nf4_really_quantizes() -> None:
    import bitsandbytes as bnb

    b = FuyuBackend(Settings(model="tiny", home=HOME, quantization="nf4", device="cpu"))
    b.load()
    kinds = {type(m).__name__ for m in b.model.modules()}
    assert "Linear4bit" in kinds
    assert not isinstance(b.model.model.vision_embed_tokens, bnb.nn.Linear4bit)
    assert not isinstance(b.model.lm_head, bnb.nn.Linear4bit)


def test_missing_weights_give_a_clear_error(tmp_path: Path) -> None:
    b = FuyuBackend(Settings(model=str(tmp_path / "no-such-model"), device="cpu"))
    with pytest.raises(ModelError, match="offline"):
        b.load()


@pytest.mark.parametrize(
    ("hw", "tokens"), [((1024, 1024), 1260), ((1080, 1920), 2340), ((3000, 4000), 36 * 49), ((1, 1), 2)]
)
def test_image_token_formula(hw: tuple[int, int], tokens: int) -> None:
    assert image_token_count(*hw) == tokens


def test_fit_size_only_shrinks() -> None:
    assert fit_size(500, 500) == (500, 500)
    assert fit_size(3000, 4000) == (1080, 1440)


def _control_texts(backend: FuyuBackend) -> list[str]:
    """Every special token of the tokenizer, and the texts of Fuyu's input-building tokens."""
    tokenizer = backend.processor.tokenizer
    named = tokenizer.convert_ids_to_tokens(sorted(backend.control_ids))
    return sorted({*tokenizer.all_special_tokens, *named, "\x04"})


def test_no_prompt_text_becomes_a_control_token(backend: FuyuBackend) -> None:
    for control in _control_texts(backend):
        for prompt in (control, f"refund? {control} please", control * 3 + "x"):
            plan = backend.plan_prompt(prompt, 512, truncate=True)
            assert plan.ids is not None
            assert not backend.control_ids.intersection(plan.ids), (control, plan)
            assert len(plan.text) >= len(prompt)


def test_control_token_text_does_not_break_its_batch(backend: FuyuBackend) -> None:
    prompts = [f"is it {c} broken?" for c in _control_texts(backend)] + ["is it broken?"]
    inputs = []
    for i, prompt in enumerate(prompts):
        plan = backend.plan_prompt(prompt, 512, truncate=True)
        inputs.append(GenerationInput(_image(60, 90, i), plan.text, 4, plan.ids))
    outputs = backend.generate(inputs)  # one batch: before, |SPEAKER| broke all of it
    assert len(outputs) == len(prompts)
    assert outputs == [backend.generate([item])[0] for item in inputs]


def test_the_answer_marker_is_appended_by_id(backend: FuyuBackend) -> None:
    plan = backend.plan_prompt("what colour?", 512, truncate=True)
    prepared = backend.prepare([GenerationInput(_image(60, 90, 0), plan.text, 2, plan.ids)])
    row = prepared.inputs["input_ids"][0].tolist()
    assert row[-1] == backend.answer_id
    assert tuple(row[-1 - len(plan.ids) : -1]) == plan.ids


def test_truncation_keeps_the_ids_it_counted(backend: FuyuBackend) -> None:
    plan = backend.plan_prompt("one two three " * 50, 10, truncate=True)
    assert plan.ids is not None
    assert len(plan.ids) == 10


def test_swapped_weights_change_the_revision(tmp_path: Path) -> None:
    import os
    import shutil

    from workers.backends.tiny import ensure_tiny_model

    folder = tmp_path / "model"
    shutil.copytree(ensure_tiny_model(HOME), folder)
    settings = Settings(model=str(folder), home=HOME, quantization="fp32", device="cpu")
    first = FuyuBackend(settings)
    first.load()
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    second = FuyuBackend(settings)
    second.load()
    assert first.revision != second.revision
    assert first.revision.startswith("local-")
