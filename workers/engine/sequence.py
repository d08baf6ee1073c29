"""One row of the running batch: what its job asked for and what it has generated so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length"]


@dataclass
class Sequence:
    """A job in the engine. `inputs` are its model inputs for a prefill alone (no padding)."""

    row_id: str
    inputs: Any
    prompt_tokens: int  # image + prompt positions the prefill writes into the cache
    max_new_tokens: int
    eos_id: int
    lane: str = "interactive"
    tokens: list[int] = field(default_factory=list)  # generated so far, the end-of-text token excluded
    finish_reason: FinishReason | None = None

    @property
    def length(self) -> int:
        """Positions this row holds in the cache once its last token is fed."""
        return self.prompt_tokens + len(self.tokens)

    @property
    def reserved_tokens(self) -> int:
        """The most cache positions it can ever hold: what admission reserves for it."""
        return self.prompt_tokens + self.max_new_tokens

    def accept(self, token: int) -> bool:
        """Take one generated token; True when the row is finished (end-of-text or its own limit)."""
        if token == self.eos_id:
            self.finish_reason = "stop"
            return True
        self.tokens.append(token)
        if len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
            return True
        return False
