"""The seam between the engine and a model: what a model's step does (`StepModel`: prefill new rows,
decode one step for every running row) and the running rows it keeps (`RowBatch`). Plain Python: the
engine and its scheduler hold to these without loading torch; workers/engine/runner.py serves
transformers' Fuyu through them, workers/backends/echo.py a model without weights."""

from __future__ import annotations

from typing import Any, Protocol

from workers.engine.masks import MaskFn


class RowBatch(Protocol):
    row_ids: list[str]
    read: int  # positions the last decode step read for these rows
    padding: int  # of those, positions no row holds

    def __len__(self) -> int: ...

    @property
    def width(self) -> int: ...

    @property
    def held(self) -> int: ...

    def add(self, row_ids: list[str], cache: Any, length: int) -> None: ...

    def drop(self, row_ids: set[str]) -> None: ...

    def absorb(self, other: Any) -> None: ...

    def take(self, row_ids: set[str]) -> Any: ...


class StepModel(Protocol):
    def new_batch(self) -> RowBatch: ...

    def prefill(self, inputs: list[Any], masks: MaskFn | None = None) -> tuple[list[int], Any, int]: ...

    def decode(self, batch: Any, last_tokens: list[int], masks: MaskFn | None = None) -> list[int]: ...
