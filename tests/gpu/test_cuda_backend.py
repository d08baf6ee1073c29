"""CUDA-only checks of the real loader; skipped where no GPU is present (CI, the dev machines)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.settings import Settings
from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")


@pytest.mark.parametrize("quantization", ["nf4", "bf16"])
def test_tiny_fuyu_on_cuda_matches_batch_and_single(quantization: str) -> None:
    backend = FuyuBackend(Settings(model="tiny", home=HOME, quantization=quantization, device="cuda"))
    backend.load()
    assert backend.describe()["device"] == "cuda"
    items = [
        GenerationInput(torch.full((3, 200, 300), 200, dtype=torch.uint8), "what colour?", 6),
        GenerationInput(torch.full((3, 900, 1200), 90, dtype=torch.uint8), "is it broken", 6),
    ]
    assert backend.generate(items) == [backend.generate([i])[0] for i in items]
