"""`GET /v1/models[/{model}]`: the models the workers serve, from their heartbeats (read at most every
5 s), and the deployment's MRC_MODEL under its own name: every name a chat request's `model` may give."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
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
        self._cached: tuple[float, list[dict[str, Any]], list[dict[str, Any]]] = (-1e18, [], [])

    def served(self, loaded_only: bool = False) -> list[dict[str, Any]]:
        """The models the workers' heartbeats name. `loaded_only`: without the workers still loading
        theirs (or refusing readiness), which name it as asked (`tiny`), not always as they will
        serve it (`tiny-fuyu-v1`): what an answer's name is guessed from."""
        with self._lock:
            at, every, loaded = self._cached
        if time.monotonic() - at >= _MODELS_CACHE_S:
            try:
                every, loaded = self._scan()
            except redis.RedisError:
                if at < 0:  # never read: the request answers 503
                    raise
                # Redis away or hung: the names last read stand for another while, instead of every
                # request waiting on Redis again (review, helper-98: each chat waited 30 s and more)
            with self._lock:
                self._cached = (time.monotonic(), every, loaded)
        return loaded if loaded_only else every

    def _scan(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        client = self._redis()
        every: dict[str, dict[str, Any]] = {}
        loaded: dict[str, dict[str, Any]] = {}
        for key in sorted(client.scan_iter(match=names.worker_pattern(), count=100)):
            raw = client.get(key)
            beat = json.loads(raw) if raw else {}
            if not beat.get("model"):
                continue
            _count(every, beat)
            if beat.get("loaded") is not False:
                _count(loaded, beat)
        return _sorted(every), _sorted(loaded)

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
        served = [entry["id"] for entry in self.served(loaded_only=True)]
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


def _count(found: dict[str, dict[str, Any]], beat: dict[str, Any]) -> None:
    model = str(beat["model"])
    entry = found.setdefault(
        model,
        {"id": model, "object": "model", "created": 0, "owned_by": "mrc", "workers": 0, "quantization": None},
    )
    entry["workers"] += 1
    entry["quantization"] = beat.get("quantization")
    # When its oldest worker started: the same on every call while that worker runs (review,
    # helper-98: the latest heartbeat's time, it changed between two calls).
    started = epoch(beat.get("started_at") or beat.get("seen_at"))
    entry["created"] = min(entry["created"], started) if entry["created"] else started


def _sorted(found: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(found.values(), key=lambda m: m["id"])
