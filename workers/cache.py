"""The context-aware result cache: a succeeded answer is reused only for the same image bytes, exactly
the same prompt as the model sees it (token ids), the same model (id, revision, quantization) and the
same generation settings."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import redis

from shared import encoding
from shared.names import cache_counter_keys, cache_entry_key
from shared.response_format import ChoiceFormat, JsonSchemaFormat, digest
from shared.settings import Settings
from workers.backends.base import ModelBackend, PromptPlan

LABEL_BYTES = 32


def prompt_label(prompt: str) -> str:
    """The prompt's first 32 bytes, cut on a UTF-8 character boundary (never half a character). A label
    for people reading the cache; never part of the key."""
    return prompt.encode("utf-8")[:LABEL_BYTES].decode("utf-8", "ignore")


def cache_key(
    *,
    model_id: str,
    revision: str,
    quantization: str,
    generation: Mapping[str, object],
    image_sha256: str,
    prompt: str | Sequence[int],
) -> str:
    """`prompt` is exactly what the model sees: its token ids where the backend has them, else its
    text. Never normalised: two prompts the model would see differently never share an answer."""
    seen = prompt if isinstance(prompt, str) else json.dumps(list(prompt))
    prompt_sha = hashlib.sha256(seen.encode("utf-8", "surrogatepass")).hexdigest()
    material = json.dumps(
        {
            "model": model_id,
            "revision": revision,
            "quantization": quantization,
            "generation": dict(sorted(generation.items())),
            "image": image_sha256,
            "prompt": prompt_sha,
        },
        sort_keys=True,
    )
    return hashlib.sha256(material.encode()).hexdigest()


def job_cache_key(
    backend: ModelBackend,
    settings: Settings,
    max_new_tokens: int,
    image_sha256: str,
    plan: PromptPlan,
    response_format: JsonSchemaFormat | ChoiceFormat | None = None,
    owner: str | None = None,
) -> str:
    """The key of one job: its model as loaded, every setting that changes the answer (its response
    format included: a constrained answer is another answer), its image bytes and its prompt exactly
    as the model sees it (token ids where the backend has them), and the API key that asked: keys are
    tenants, and a hit (`cache_hit`, `cached_tokens`) would tell one key that another sent the same
    photo and question (shared/tenants.py). Jobs without a key share answers as before."""
    generation: dict[str, object] = {
        "decoding": "greedy",
        "max_new_tokens": max_new_tokens,
        "max_prompt_tokens": settings.max_prompt_tokens,
        "truncate_prompts": settings.truncate_prompts,
        "max_image_side": settings.max_image_side,
    }
    if response_format is not None:  # free jobs keep the keys they always had
        generation["response_format"] = digest(response_format)
    if owner is not None:
        generation["tenant"] = owner
    return cache_key(
        model_id=backend.model_id,
        revision=backend.revision,
        quantization=backend.quantization,
        generation=generation,
        image_sha256=image_sha256,
        prompt=plan.text if plan.ids is None else plan.ids,
    )


class ResultCache(Protocol):
    def get(self, key: str) -> dict[str, Any] | None: ...
    def get_many(self, keys: list[str]) -> list[dict[str, Any] | None]: ...
    def put(self, key: str, value: dict[str, Any], ttl_s: int) -> None: ...


class RedisResultCache:
    """Entries under mrc:cache:<key> with a TTL; hit and miss counters for the ops view."""

    HITS, MISSES = cache_counter_keys()

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client

    def get(self, key: str) -> dict[str, Any] | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str]) -> list[dict[str, Any] | None]:
        """A delivery's look-ups in one round trip, and the hit/miss counters in one more."""
        if not keys:
            return []
        raws = self._redis.mget([cache_entry_key(key) for key in keys])
        hits = sum(raw is not None for raw in raws)
        with self._redis.pipeline(transaction=False) as pipe:
            pipe.incrby(self.HITS, hits)
            pipe.incrby(self.MISSES, len(keys) - hits)
            pipe.execute()
        return [None if raw is None else dict(json.loads(raw)) for raw in raws]

    def put(self, key: str, value: dict[str, Any], ttl_s: int) -> None:
        self._redis.set(cache_entry_key(key), encoding.to_text(value), ex=ttl_s)
