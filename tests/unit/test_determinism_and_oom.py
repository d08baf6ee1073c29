"""The real backend on the tiny Fuyu: greedy outputs do not depend on batch neighbours, and a CUDA
out-of-memory fault (injected, as there is no GPU here) splits the batch down to the job that cannot fit."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.memory_records import MemoryJobRecords
from shared.settings import Settings
from shared.stores.memory import MemoryStore
from tests.support import imagegen
from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend
from workers.pipeline import assemble
from workers.slots import Message

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")


@pytest.fixture(scope="module")
def backend() -> FuyuBackend:
    b = FuyuBackend(Settings(model="tiny", home=HOME, quantization="nf4", device="cpu"))
    b.load()
    return b


def _image(height: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=g)


def test_same_job_same_text_in_100_batch_compositions(backend: FuyuBackend) -> None:
    target = GenerationInput(_image(120, 200, 0), "Can I get a refund for this parcel?", 12)
    rng = random.Random(7)
    others = [
        GenerationInput(_image(rng.randint(20, 260), rng.randint(20, 260), i), p, rng.randint(1, 16))
        for i, p in enumerate(
            ["a", "这是什么？", "what colour is the box", "x " * 30, "refund?", "😀 | \\n"], 1
        )
    ]
    texts = set()
    for _ in range(100):
        batch = rng.sample(others, rng.randint(0, 5))
        position = rng.randint(0, len(batch))
        batch.insert(position, target)
        texts.add(backend.generate(batch)[position].text)
    assert len(texts) == 1


def test_out_of_memory_splits_down_to_one_job(backend: FuyuBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore("mrc")
    for name, (w, h) in {"small": (160, 120), "huge": (1900, 1000)}.items():
        store.put_bytes(f"inputs/{name}.png", imagegen.photo(w, h, fmt="PNG"), "image/png")
    messages = [
        Message(
            f"j{i}",
            {"job_id": f"j{i}", "image_uri": f"s3://mrc/inputs/{n}.png", "prompt": "q", "max_new_tokens": 4},
        )
        for i, n in enumerate(["small", "small", "huge", "small"])
    ]
    real_generate = backend.model.generate
    sizes: list[int] = []

    def generate(**inputs: Any) -> Any:
        rows, images = inputs["input_ids"].shape[0], inputs["pixel_values"].shape[0]
        sizes.append(rows)
        if rows > 1 or images > 1000:  # a batch, or the one huge image: "does not fit"
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_generate(**inputs)

    monkeypatch.setattr(backend.model, "generate", generate)
    records = MemoryJobRecords()
    settings = Settings(max_attempts=1, batch_max_padding=1.0)  # all four in one batch, huge included
    pipeline = assemble(backend, store, store, records, settings, sleep=lambda _s: None)
    assert pipeline.run(messages) == ["succeeded", "succeeded", "failed", "succeeded"]
    assert [entry["job_id"] for entry in records.dlq] == ["j2"]
    error = store.get_result("j2")["error"]
    assert error["code"] == "out_of_memory"
    assert error["retryable"] is True
    assert sizes[0] == 4
    assert sizes.count(1) == 4
    monkeypatch.undo()
    alone = backend.generate([GenerationInput(_image_from(store, "small"), "q", 4)])[0].text
    assert {store.get_result(f"j{i}")["text"] for i in (0, 1, 3)} == {alone}


def _image_from(store: MemoryStore, name: str) -> torch.Tensor:
    from workers import images

    data = store.get_bytes("mrc", f"inputs/{name}.png", 10**8)
    assert data is not None
    return images.load(data, 10**8).tensor
