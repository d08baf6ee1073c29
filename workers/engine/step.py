"""The seam between the engine and a model: what a model's step does (`StepModel`: give a row a slot
and its cached prefix, prefill rows in chunks (every row's chunk in one call), decode one step for
every running row) and the running rows it keeps (`RowBatch`). Plain Python: the engine and its
scheduler hold to these without loading torch; workers/engine/runner.py serves transformers' Fuyu
through them, workers/backends/echo.py a model without weights."""

from __future__ import annotations

from collections.abc import Hashable
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

    def join(self, row_id: str) -> None: ...

    def drop(self, row_ids: set[str], keep: bool = False) -> None: ...

    def absorb(self, other: Any) -> None: ...

    def take(self, row_ids: set[str]) -> Any: ...


class StepModel(Protocol):
    def new_batch(self) -> RowBatch: ...

    def begin(
        self, row_id: str, inputs: Any, length: int, identity: Hashable | None = None, need: int | None = None
    ) -> int:
        """Take a slot with room for `need` positions for a row about to prefill (`length` positions);
        the leading positions reused from the cache."""

    def catch_up(self, row_id: str) -> int:
        """Positions of the row's prefix other rows wrote since it began, now in its slot too."""

    def extend(self, chunks: list[tuple[str, int]], masks: MaskFn | None = None) -> list[int | None]:
        """Prefill each row up to its `stop` (one chunk a row, all in one call); each row's first token
        once its prompt is whole, else None. `masks`: the grammar mask of the rows whose prompt ends."""

    def sharing(self, row_id: str, writers: list[tuple[str, int]]) -> bool:
        """Whether these chunks write the prefix block the row computes next (it waits and copies it)."""

    def abandon(self, row_id: str, keep: bool = False) -> None:
        """A row that leaves during its prefill."""

    def decode(self, batch: Any, last_tokens: list[int], masks: MaskFn | None = None) -> list[int]: ...
