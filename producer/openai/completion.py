"""A job's result as the answer OpenAI's clients expect: a `chat.completion`, or the error its code
maps to (producer/openai/errors.py). The chat route and a batch's output file answer alike."""

from __future__ import annotations

import time
from typing import Any

from producer.openai.errors import OpenAIError, result_status
from shared.jobs import parse_rfc3339


def chat_completion(result: dict[str, Any], finish_reason: str) -> dict[str, Any]:
    """A result object as OpenAI's `chat.completion` (id = the job id)."""
    usage = result.get("usage") or {}
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    model = result.get("model") or {}
    return {
        "id": result["job_id"],
        "object": "chat.completion",
        "created": epoch(result.get("submitted_at")),
        "model": model.get("id"),
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": result.get("text") or "",
                    "refusal": None,
                    "annotations": [],
                },
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                # A reused answer: all of it; else what the engine's prefix cache held (same photo, key).
                "cached_tokens": prompt if result.get("cache_hit") else int(usage.get("cached_tokens", 0)),
                "image_tokens": int(usage.get("image_tokens", 0)),
            },
        },
        "system_fingerprint": f"{model.get('id')}/{model.get('quantization')}",
        "service_tier": "default",
    }


def completion(result: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """What the endpoint answers for a job's result: 200 and a chat.completion (a constrained answer
    cut at max_tokens too, `finish_reason: length`, as OpenAI answers one), else the error its code
    maps to (producer/openai/errors.py), naming the job."""
    error = result.get("error") or {}
    if result.get("status") == "succeeded":
        return 200, chat_completion(result, str(result.get("finish_reason") or "stop"))
    if error.get("code") == "answer_incomplete":
        return 200, chat_completion(result, "length")
    code = str(error.get("code") or "internal_error")
    job_id = str(result.get("job_id"))
    message = f"job {job_id} failed ({code}): {error.get('message', '')}"
    return result_status(code), OpenAIError(
        result_status(code), message, None, code, extra={"job_id": job_id}
    ).body()


def epoch(stamp: object) -> int:
    try:
        return int(parse_rfc3339(str(stamp)).timestamp())
    except ValueError:
        return int(time.time())
