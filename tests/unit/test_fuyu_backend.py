"""The real loader on the tiny Fuyu, on the CPU: NF4 and the unquantized modes through the same code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.errors import ModelError, PromptTooLong
from shared.settings import Settings
from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend
from workers.preprocess import fit_size, image_token_count

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
    assert info["model"] == "tiny-fuyu-v1" and info["device"] == "cpu"
    assert info["quantization"] in ("nf4", "fp32") and info["attention_backend"]


def test_prompt_planning(backend: FuyuBackend) -> None:
    plan = backend.plan_prompt("one two three " * 50, 10, truncate=True)
    assert plan.truncated and plan.tokens == 10 and plan.original_tokens > 10
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
