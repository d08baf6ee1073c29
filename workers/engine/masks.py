"""The grammar mask of one model call: which tokens each row may take next, as one bitmask for the
whole batch (xgrammar's layout: a row of 32-bit words per row, a set bit = allowed).

Only constrained rows are filled (their matchers in one call, on the library's threads); a free row
keeps the all-allowed row `allocate_token_bitmask` starts with, so masking leaves its logits, and its
tokens, exactly as they were. The mask is applied to the logits on the model's device in one kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class RowConstraint(Protocol):
    matcher: Any
    vocab_size: int
    keep: Any  # a mask row ANDed into this row's (workers/utf8_guard.py: only valid UTF-8), or None

    def accept(self, token: int) -> None: ...

    @property
    def complete(self) -> bool: ...

    def only_end_left(self, eos_id: int) -> bool: ...

    def reset(self) -> None: ...


# A model call asks for its mask after it has launched the forward pass (on CUDA the CPU fills the
# mask while the device computes); None: no row is constrained.
MaskFn = Callable[[], Any]

_batch_matcher: Any = None


def for_rows(constraints: Sequence[RowConstraint | None]) -> Any:
    """The bitmask for rows in batch order (None where no row is constrained)."""
    indices = [i for i, c in enumerate(constraints) if c is not None]
    if not indices:
        return None
    import xgrammar

    chosen = [constraints[i] for i in indices]
    mask = xgrammar.allocate_token_bitmask(len(constraints), chosen[0].vocab_size)  # type: ignore[union-attr]
    if len(chosen) == 1:
        chosen[0].matcher.fill_next_token_bitmask(mask, indices[0])  # type: ignore[union-attr]
    else:
        _batch().batch_fill_next_token_bitmask([c.matcher for c in chosen], mask, indices)  # type: ignore[union-attr]
    for index, constraint in zip(indices, chosen, strict=True):
        if constraint is not None and constraint.keep is not None:
            mask[index] &= constraint.keep
    return mask


def apply(logits: Any, mask: Any) -> Any:
    """Disallowed tokens to -inf, in place on the logits' device; returns the logits (float32)."""
    import xgrammar

    logits = logits.float().contiguous()
    xgrammar.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True))
    return logits


def _batch() -> Any:
    global _batch_matcher
    if _batch_matcher is None:
        import xgrammar

        _batch_matcher = xgrammar.BatchGrammarMatcher()
    return _batch_matcher
