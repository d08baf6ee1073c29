"""An in-process model for unit tests of the pipeline: answers from the prompt, no torch, no weights."""

from __future__ import annotations

import time
from typing import Any

from shared.errors import PromptTooLong
from workers.backends import fuyu_geometry
from workers.backends.base import GenerationInput, GenerationOutput, Prepared, PromptPlan


class EchoBackend:
    """Deterministic stand-in for a ModelBackend: the answer names the image size and the prompt.

    `fail_on` makes generate raise when a prompt contains that marker, to test fault isolation;
    `token_s` makes each batch take that long per step of its longest answer (a model of known speed).
    """

    model_id = "echo"
    revision = "echo-1"
    quantization = "fp32"
    device = "cpu"

    def __init__(
        self, fail_on: str | None = None, error: Exception | None = None, token_s: float = 0.0
    ) -> None:
        self.fail_on = fail_on
        self.token_s = token_s
        self.error = error or RuntimeError("injected model fault")
        self.calls: list[int] = []

    def load(self) -> None:
        return None

    def plan_prompt(self, prompt: str, max_tokens: int, truncate: bool) -> PromptPlan:
        words = prompt.split()
        if len(words) <= max_tokens:
            return PromptPlan(prompt, len(words), len(words), False)
        if not truncate:
            raise PromptTooLong(f"prompt has {len(words)} tokens; the limit is {max_tokens}")
        return PromptPlan(" ".join(words[:max_tokens]), max_tokens, len(words), True)

    def image_tokens(self, height: int, width: int) -> int:
        return fuyu_geometry.image_token_count(height, width)

    def fit_image(self, image: Any) -> Any:
        return image

    def prepare(self, batch: list[GenerationInput]) -> Prepared:
        return Prepared(inputs=list(batch), max_new_tokens=tuple(i.max_new_tokens for i in batch))

    def run(self, prepared: Prepared) -> list[GenerationOutput]:
        batch: list[GenerationInput] = prepared.inputs
        self.calls.append(len(batch))
        if self.fail_on and any(self.fail_on in item.prompt for item in batch):
            raise self.error
        if self.token_s and batch:
            time.sleep(self.token_s * max(item.max_new_tokens for item in batch))
        outputs = []
        for item in batch:
            height, width = item.image.shape[-2:]
            text = f"{width}x{height}: {item.prompt}"[: item.max_new_tokens * 8]
            outputs.append(GenerationOutput(text=text, output_tokens=len(text.split())))
        return outputs

    def generate(self, batch: list[GenerationInput]) -> list[GenerationOutput]:
        return self.run(self.prepare(batch))

    def warm_up(self) -> str:
        return "none"

    def describe(self) -> dict[str, str]:
        return {
            "model": self.model_id,
            "quantization": self.quantization,
            "device": self.device,
            "attention_backend": "none",
        }
