from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.memory_records import MemoryJobRecords
from shared.settings import Settings
from shared.stores.memory import MemoryStore
from tests.support import imagegen
from workers.backends.echo import EchoBackend
from workers.cache import cache_key, prompt_label
from workers.memory_cache import MemoryResultCache
from workers.pipeline import Pipeline, assemble
from workers.slots import Message

BASE: dict[str, Any] = {
    "model_id": "adept/fuyu-8b",
    "revision": "abc",
    "quantization": "nf4",
    "generation": {"max_new_tokens": 64},
    "image_sha256": "0" * 64,
    "prompt": "这个包裹在运输途中被压坏了，请问我可以申请全额退款吗？",
}


def test_prompts_sharing_their_first_32_bytes_never_share_a_key() -> None:
    other = {**BASE, "prompt": "这个包裹在运输途中被压坏了，请问我可以申请部分退款吗？"}
    assert prompt_label(BASE["prompt"]) == prompt_label(other["prompt"])
    assert cache_key(**BASE) != cache_key(**other)


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "tiny-fuyu-v1"},
        {"revision": "def"},
        {"quantization": "bf16"},
        {"generation": {"max_new_tokens": 65}},
        {"image_sha256": "1" * 64},
        {"prompt": BASE["prompt"] + "!"},
    ],
)
def test_every_part_of_the_context_is_in_the_key(change: dict[str, Any]) -> None:
    assert cache_key(**{**BASE, **change}) != cache_key(**BASE)


def test_the_key_is_exactly_what_the_model_sees() -> None:
    # The model sees whitespace and Unicode forms as they are: so does the key.
    assert cache_key(**{**BASE, "prompt": " a  b "}) != cache_key(**{**BASE, "prompt": "a b"})
    assert cache_key(**{**BASE, "prompt": "e\u0301"}) != cache_key(**{**BASE, "prompt": "\u00e9"})
    # Token ids, where the backend has them: equal ids are one key, whatever text produced them.
    assert cache_key(**{**BASE, "prompt": (5, 6, 7)}) == cache_key(**{**BASE, "prompt": [5, 6, 7]})
    assert cache_key(**{**BASE, "prompt": (5, 6, 7)}) != cache_key(**{**BASE, "prompt": (5, 6)})


@given(st.text())
def test_label_is_a_valid_prefix_of_at_most_32_bytes(prompt: str) -> None:
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        return
    label = prompt_label(prompt)
    assert len(label.encode("utf-8")) <= 32
    assert prompt.startswith(label)
    assert len(prompt.encode("utf-8")) <= 32 or len(label.encode("utf-8")) > 28


def test_label_never_cuts_a_chinese_character() -> None:
    label = prompt_label(BASE["prompt"])  # 3-byte characters: 32 bytes = 10 characters and 2 bytes
    assert label == BASE["prompt"][:10]
    assert len(label.encode()) == 30


def _run(
    pipeline: Pipeline, store: MemoryStore, job_id: str, prompt: str, image: str = "a"
) -> dict[str, Any]:
    body = {
        "job_id": job_id,
        "image_uri": f"s3://mrc/inputs/{image}.jpg",
        "prompt": prompt,
        "max_new_tokens": 8,
    }
    pipeline.run([Message(job_id, body)])
    result = store.get_result(job_id)
    assert result is not None
    return result


@pytest.fixture
def store() -> MemoryStore:
    s = MemoryStore("mrc")
    s.put_bytes("inputs/a.jpg", imagegen.photo(64, 48), "image/jpeg")
    s.put_bytes("inputs/b.jpg", imagegen.photo(64, 48, seed=5), "image/jpeg")
    s.put_bytes("inputs/bad.jpg", imagegen.truncated_jpeg(), "image/jpeg")
    return s


def _pipeline(store: MemoryStore, cache: MemoryResultCache, backend: EchoBackend, **kw: Any) -> Pipeline:
    return assemble(
        backend, store, store, MemoryJobRecords(), Settings(**kw), sleep=lambda _s: None, cache=cache
    )


def test_hit_skips_the_model_and_still_writes_its_own_result(store: MemoryStore) -> None:
    cache, backend = MemoryResultCache(), EchoBackend()
    pipeline = _pipeline(store, cache, backend)
    first = _run(pipeline, store, "c1", BASE["prompt"])
    second = _run(pipeline, store, "c2", BASE["prompt"])
    assert first["cache_hit"] is False
    assert second["cache_hit"] is True
    assert second["text"] == first["text"]
    assert second["status"] == "succeeded"
    assert len(backend.prefills) == 1
    assert [e[1]["label"] for e in cache.entries.values()] == [prompt_label(BASE["prompt"])]


def test_misses(store: MemoryStore) -> None:
    cache, backend = MemoryResultCache(), EchoBackend()
    pipeline = _pipeline(store, cache, backend)
    _run(pipeline, store, "m1", BASE["prompt"])
    assert (
        _run(pipeline, store, "m2", "这个包裹在运输途中被压坏了，请问我可以申请部分退款吗？")["cache_hit"]
        is False
    )
    assert _run(pipeline, store, "m3", BASE["prompt"], image="b")["cache_hit"] is False
    other_quant = EchoBackend()
    other_quant.quantization = "bf16"
    assert _run(_pipeline(store, cache, other_quant), store, "m4", BASE["prompt"])["cache_hit"] is False
    other_model = EchoBackend()
    other_model.model_id = "echo-2"
    assert _run(_pipeline(store, cache, other_model), store, "m5", BASE["prompt"])["cache_hit"] is False
    assert len(backend.prefills) == 3


def test_failed_jobs_are_never_cached(store: MemoryStore) -> None:
    cache = MemoryResultCache()
    pipeline = _pipeline(store, cache, EchoBackend(fail_on="boom"), max_attempts=1)
    assert _run(pipeline, store, "f1", "boom")["status"] == "failed"
    assert _run(pipeline, store, "f2", "q", image="bad")["status"] == "failed"
    assert cache.entries == {}


def test_ttl_zero_switches_the_cache_off(store: MemoryStore) -> None:
    cache, backend = MemoryResultCache(), EchoBackend()
    pipeline = _pipeline(store, cache, backend, cache_ttl_s=0)
    _run(pipeline, store, "o1", "same")
    assert _run(pipeline, store, "o2", "same")["cache_hit"] is False
    assert cache.entries == {}
