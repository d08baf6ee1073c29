"""A step model that hands every call to another (the echo model's, or the real runner): fakes in the
engine's tests subclass it and override the one call they break."""

from __future__ import annotations

from typing import Any


class StepProxy:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def new_batch(self) -> Any:
        return self.inner.new_batch()

    def begin(self, row_id: str, inputs: Any, length: int, identity: Any = None, need: Any = None) -> int:
        return int(self.inner.begin(row_id, inputs, length, identity, need))

    def catch_up(self, row_id: str) -> int:
        return int(self.inner.catch_up(row_id))

    def extend(self, chunks: list[tuple[str, int]], masks: Any = None) -> list[int | None]:
        return [None if token is None else int(token) for token in self.inner.extend(chunks, masks)]

    def sharing(self, row_id: str, writers: list[tuple[str, int]]) -> bool:
        return bool(self.inner.sharing(row_id, writers))

    def abandon(self, row_id: str, keep: bool = False) -> None:
        self.inner.abandon(row_id, keep)

    def decode(self, batch: Any, last: list[int], masks: Any = None) -> list[int]:
        return list(self.inner.decode(batch, last, masks))
