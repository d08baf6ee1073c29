"""The real backend on the tiny Fuyu, NF4, through the engine: a job's tokens do not depend on the
rows it shares decode steps with, and a CUDA out-of-memory fault (injected, as there is no GPU here)
fails only the job that cannot fit even alone; its neighbours are recomputed and succeed."""

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
from tests.support.engine_runs import engine_tokens
from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend
from workers.pipeline import assemble
from workers.slots import Message

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")
NEW = 24  # new tokens of each small job (see test_out_of_memory_fails_only_the_job_that_cannot_fit_alone)


@pytest.fixture(scope="module")
def backend() -> FuyuBackend:
    b = FuyuBackend(Settings(model="tiny", home=HOME, quantization="nf4", device="cpu"))
    b.load()
    return b


def _image(height: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("decode", ["rows", "fixed", "pool"])
def test_same_job_same_tokens_in_30_engine_compositions(backend: FuyuBackend, decode: str) -> None:
    """NF4 on the CPU: the target's tokens alone equal its tokens beside any neighbours, joining at
    any step, with every decode step (the fp32 oracle against generate() is tests/unit/test_engine.py;
    bit for bit, the pool step's rows in tests/unit/test_pool_step.py)."""
    target = GenerationInput(_image(120, 200, 0), "Can I get a refund for this parcel?", 12)
    rng = random.Random(7)
    others = [
        GenerationInput(_image(rng.randint(20, 260), rng.randint(20, 260), i), p, rng.randint(1, 16))
        for i, p in enumerate(
            ["a", "这是什么？", "what colour is the box", "x " * 30, "refund?", "😀 | \\n"], 1
        )
    ]
    alone = engine_tokens(backend, [target], [0], decode=decode)[0]
    for _ in range(30):
        batch = rng.sample(others, rng.randint(1, 5))
        position = rng.randint(0, len(batch))
        batch.insert(position, target)
        arrivals = [rng.randint(0, 6) for _ in batch]
        assert engine_tokens(backend, batch, arrivals, decode=decode)[position] == alone


def test_out_of_memory_fails_only_the_job_that_cannot_fit_alone(
    backend: FuyuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MemoryStore("mrc")
    for name, (w, h) in {"small": (160, 120), "huge": (1900, 1000)}.items():
        store.put_bytes(f"inputs/{name}.png", imagegen.photo(w, h, fmt="PNG"), "image/png")
    # The small jobs come first and answer long enough to be in memory together whatever the machine's
    # speed: each row is handed to the engine once its own image is ready, and with 4 tokens the first
    # could end before the next arrived on a loaded machine, or the huge one's failure could lower the
    # ceiling to one row first; then no step of two rows was ever tried.
    jobs = [("small", NEW), ("small", NEW), ("small", NEW), ("huge", 4)]
    messages = [
        Message(
            f"j{i}",
            {"job_id": f"j{i}", "image_uri": f"s3://mrc/inputs/{n}.png", "prompt": "q", "max_new_tokens": k},
        )
        for i, (n, k) in enumerate(jobs)
    ]
    language = backend.model.model.language_model  # every model call, prefill and decode, goes through it
    real_forward = language.forward
    calls: list[tuple[int, int]] = []

    def forward(**inputs: Any) -> Any:
        rows, positions = inputs["inputs_embeds"].shape[:2]
        calls.append((rows, positions))
        width = int(inputs["position_ids"].max()) + 1  # the positions its widest row attends to
        if width > 1000 or (rows > 1 and positions == 1):  # the huge prefill, a shared decode step
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_forward(**inputs)

    monkeypatch.setattr(language, "forward", forward)
    records = MemoryJobRecords()
    pipeline = assemble(backend, store, store, records, Settings(max_attempts=1), sleep=lambda _s: None)
    try:
        assert pipeline.run(messages) == ["succeeded", "succeeded", "succeeded", "failed"]
    finally:
        pipeline.close()
    assert [entry["job_id"] for entry in records.dlq] == ["j3"]
    error = store.get_result("j3")["error"]
    assert error["code"] == "out_of_memory"
    assert error["retryable"] is True
    assert any(rows > 1 for rows, _ in calls), "no step of two rows was tried"
    monkeypatch.undo()
    alone = backend.generate([GenerationInput(_image_from(store, "small"), "q", NEW)])[0].text
    assert {store.get_result(f"j{i}")["text"] for i in (0, 1, 2)} == {alone}


def _image_from(store: MemoryStore, name: str) -> torch.Tensor:
    from workers import images

    data = store.get_bytes("mrc", f"inputs/{name}.png", 10**8)
    assert data is not None
    return images.load(data, 10**8).tensor
