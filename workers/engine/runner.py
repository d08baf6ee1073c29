"""The engine's only model calls (torch): prefill jobs of one input length together (unpadded),
decode one step for the batch.

`StepModel` is the seam: this runner serves transformers' Fuyu; the echo backend has its own
(workers/backends/echo.py), so the worker's tests drive the same engine without weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from workers.engine import masks as grammar_masks
from workers.engine.kv import Batch
from workers.engine.masks import MaskFn
from workers.engine.sequence import DEAD_END


class RowBatch(Protocol):
    row_ids: list[str]

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


# Sets the CPU threads for a model call of that many positions (workers/cpu_threads.py); None: as is.
Threads = Callable[[int], object] | None


class Runner:
    def __init__(self, model: Any, threads: Threads = None) -> None:
        self.model = model
        self.threads = threads

    def new_batch(self) -> Batch:
        return Batch()

    @torch.inference_mode()
    def prefill(self, inputs: list[Any], masks: MaskFn | None = None) -> tuple[list[int], Any, int]:
        """(each row's first generated token, the rows' cache, positions each holds) for jobs of one
        input length, prefilled together: no padding, so prefill takes the causal path, no mask.
        `masks`: the rows' grammar mask (structured answers), asked for once the call is launched."""
        joined = inputs[0] if len(inputs) == 1 else {k: torch.cat([i[k] for i in inputs]) for k in inputs[0]}
        length = int(joined["input_ids"].shape[1])
        if self.threads is not None:
            self.threads(int(joined["input_ids"].numel()))
        out = _freeing_on_oom(lambda: self.model(**joined, use_cache=True, logits_to_keep=1))
        return _pick(out.logits[:, -1], masks), out.cache, length

    @torch.inference_mode()
    def decode(self, batch: Batch, last_tokens: list[int], masks: MaskFn | None = None) -> list[int]:
        """One step for every running row: feed each row's last token, return each row's next."""
        assert batch.mask is not None
        mask, positions = batch.next_step()
        if self.threads is not None:
            self.threads(int(mask.numel()))
        ids = torch.tensor(last_tokens, dtype=torch.long, device=mask.device).unsqueeze(1)
        out = _freeing_on_oom(
            lambda: self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, cache=batch.cache, use_cache=True
            )
        )
        batch.commit(mask, out.cache)
        return _pick(out.logits[:, -1], masks)


def _pick(logits: Any, masks: MaskFn | None) -> list[int]:
    """Greedy: each row's most likely token, among those its grammar allows where it has one; a row
    whose grammar allows no token at all (a dead end of its schema) gets DEAD_END instead."""
    bitmask = masks() if masks is not None else None
    if bitmask is None:
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    logits = grammar_masks.apply(logits, bitmask)
    best, tokens = logits.max(dim=-1)
    dead = torch.isneginf(best)
    return [DEAD_END if d else int(t) for t, d in zip(tokens.tolist(), dead.tolist(), strict=True)]


def _freeing_on_oom(call: Any) -> Any:
    """Out of memory is settled by the engine (fewer rows, then retry): give the allocator's cached
    blocks back first, so the retry sees the memory the failed call took."""
    try:
        return call()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise
