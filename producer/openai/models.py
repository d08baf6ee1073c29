"""`GET /v1/models[/{model}]`: the models the workers serve, from their heartbeats (read at most every
5 s), and the deployment's MRC_MODEL under its own name: every name a chat request's `model` may give."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from producer.openai.completion import epoch
from producer.openai.errors import OpenAIError
from shared import names
from shared.settings import Settings

_MODELS_CACHE_S = 5.0


class Models:
    """The models the workers serve, from their heartbeats (read at most every 5 s)."""

    def __init__(self, settings: Settings, redis: Callable[[], Any]) -> None:
        self.settings, self._redis = settings, redis
        self._lock = threading.Lock()
        self._cached: tuple[float, list[dict[str, Any]]] = (-1e18, [])

    def served(self) -> list[dict[str, Any]]:
        with self._lock:
            at, models = self._cached
            if time.monotonic() - at < _MODELS_CACHE_S:
                return models
        client = self._redis()
        found: dict[str, dict[str, Any]] = {}
        for key in sorted(client.scan_iter(match=names.worker_pattern(), count=100)):
            raw = client.get(key)
            beat = json.loads(raw) if raw else {}
            model = beat.get("model")
            # A worker loading its model (or refusing readiness) names the model as asked (`tiny`), not
            # as it serves it (`tiny-fuyu-v1`): it serves nothing yet.
            if not model or beat.get("loaded") is False:
                continue
            entry = found.setdefault(
                str(model),
                {
                    "id": str(model),
                    "object": "model",
                    "created": 0,
                    "owned_by": "mrc",
                    "workers": 0,
                    "quantization": None,
                },
            )
            entry["workers"] += 1
            entry["quantization"] = beat.get("quantization")
            entry["created"] = max(entry["created"], epoch(beat.get("seen_at")))
        models = sorted(found.values(), key=lambda m: m["id"])
        with self._lock:
            self._cached = (time.monotonic(), models)
        return models

    def listed(self) -> list[dict[str, Any]]:
        """`GET /v1/models`: the models the workers serve, and the deployment's MRC_MODEL under that
        name too when the workers report it by another (a folder, say) or none is up yet: every name
        a request may give `model` is listed, and answers `GET /v1/models/{model}`."""
        served = self.served()
        if any(entry["id"] == self.settings.model for entry in served):
            return served
        workers = sum(entry["workers"] for entry in served)
        alias = {
            "id": self.settings.model,
            "object": "model",
            "created": max((entry["created"] for entry in served), default=0),
            "owned_by": "mrc",
            "workers": workers,
            "quantization": served[0]["quantization"] if len(served) == 1 else None,
        }
        return sorted([*served, alias], key=lambda entry: str(entry["id"]))

    def known(self) -> frozenset[str]:
        """What a request may name: a model a worker serves, or the deployment's MRC_MODEL (its jobs
        wait in the queue while no worker is up)."""
        return frozenset(entry["id"] for entry in self.listed())

    def answering(self, model: str) -> str:
        """The name the answer will carry (a plain answer's `model`, from its result): `model` when a
        worker serves it by that name, else, for MRC_MODEL standing for the one model served, that one."""
        served = [entry["id"] for entry in self.served()]
        return served[0] if model not in served and len(served) == 1 else model

    def check(self, model: str) -> None:
        if model not in self.known():
            raise OpenAIError(
                404,
                f"The model `{model[:100]}` does not exist (GET /v1/models lists them)",
                "model",
                "model_not_found",
            )

    async def models_list(self, request: Request) -> Response:
        models = await run_in_threadpool(self.listed)
        return JSONResponse({"object": "list", "data": models})

    async def model(self, model: str, request: Request) -> Response:
        """Every name a request may give `model` (what `Models.check` accepts) answers here."""
        models = await run_in_threadpool(self.listed)
        for entry in models:
            if entry["id"] == model:
                return JSONResponse(entry)
        raise OpenAIError(404, f"The model `{model[:100]}` does not exist", "model", "model_not_found")
