"""One row of the running batch: what its job asked for, what it has generated, why it ended."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.errors import AnswerIncomplete, InvalidJob, MrcError
from workers.engine.masks import RowConstraint

FinishReason = Literal["stop", "length"]
# The token a model call reports for a row whose grammar mask allowed no token at all.
DEAD_END = -1


@dataclass(eq=False)
class Sequence:
    """A job in the engine. `inputs` are its model inputs, unpadded (it prefills alone, or beside
    rows of the same input length)."""

    row_id: str
    inputs: Any
    prompt_tokens: int  # image + prompt positions the prefill writes into the cache
    max_new_tokens: int
    eos_id: int
    lane: str = "interactive"
    # Suspects run only beside their own group: a delivery's jobs that were in hand when its worker
    # died, or the rows of a decode step that failed (split in two at each failure, down to one row).
    group: str | None = None
    deadline: float | None = None  # wall-clock seconds; past it at admission, the row expires
    cancelled: bool = False  # its run was cancelled while it waited (workers/cancel_watch.py): dropped
    exact_steps: bool = False  # generate max_new_tokens past end-of-text (timing probes only)
    constraint: RowConstraint | None = None  # its grammar (structured answers); None: free text
    # What decides its prefix's positions besides the token ids (workers/engine/prefix_index.py): the
    # image's sha256, the size it was fitted to, the key that sent it. None: it never shares a prefix.
    identity: Hashable | None = None
    stream_to: str | None = None  # the job whose stream gets its text as it is decoded (workers/streaming.py)
    computed: int = 0  # prompt positions in its slot so far (reused or prefilled)
    cached_tokens: int = 0  # of its prompt, positions reused from the cache at its last admission
    looked_up: bool = False  # counted in the hit ratio (once, at its first admission: not again when paused)
    tokens: list[int] = field(default_factory=list)  # generated so far, the end-of-text token excluded
    finish_reason: FinishReason | None = None
    error: MrcError | None = None  # why it failed, when it did
    # Wall-clock seconds, set by the engine: first admitted (its queue wait ends), admitted for the run
    # that made its answer, that run's first token, finished. A pause or a failed step starts a new run.
    submitted_at: float = 0.0
    first_admitted_at: float | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    masked_steps: int = 0  # decode steps of its last run whose attention read padding under a mask
    restarts: int = 0  # times it was paused (or its batch failed) and recomputed from its prompt
    pauses: int = 0  # of those, times it was paused for a ticket (capped while the backlog has a share)
    turn: bool = False  # its last admission was on the backlog's turn (its share): tickets leave it be
    # How the scheduler saw it last (workers/engine/rows.py): made again only when what it shows changed.
    seen: Any = field(default=None, repr=False)

    @property
    def need(self) -> int:
        """Positions its slot must hold: its prompt and every token it may feed back. The last token it
        generates is never fed, so that is one less than its prompt and `max_new_tokens`: the same
        count the engine refuses an oversized job by (a job that needed exactly a slot's positions
        passed that check, then asked for one more and failed as a model error)."""
        return self.prompt_tokens + max(0, self.max_new_tokens - 1)

    @property
    def length(self) -> int:
        """Positions this row holds in the cache once its last token is fed."""
        return self.prompt_tokens + len(self.tokens)

    def accept(self, token: int) -> bool:
        """Take one generated token; True when the row is finished (end-of-text or its own limit).
        A constrained row that reaches its limit before its answer is whole fails `answer_incomplete`."""
        if token == DEAD_END:  # the grammar allowed nothing: the schema's fault, never the model's
            self.error = InvalidJob(
                f"the response_format allows no continuation after {len(self.tokens)} generated tokens (a "
                "pattern or recursive $ref that matches nothing from here): no answer can satisfy it"
            )
            return True
        if self.constraint is not None:
            try:
                self.constraint.accept(token)
            except MrcError as exc:
                self.error = exc
                return True
        if token == self.eos_id and not self.exact_steps:
            self.finish_reason = "stop"
            return True
        self.tokens.append(token)
        if (
            self.constraint is not None
            and not self.exact_steps
            and self.constraint.only_end_left(self.eos_id)
        ):
            self.finish_reason = "stop"  # whole, and only end-of-text may follow: the step is saved
            return True
        if len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
            if self.constraint is not None and not self.constraint.complete:
                self.error = AnswerIncomplete(
                    f"the constrained answer reached max_new_tokens ({self.max_new_tokens}) before it was "
                    "complete; raise max_new_tokens or simplify the format"
                )
            return True
        return False

    def restart(self) -> None:
        """Back to waiting, to be recomputed from its prompt: greedy decoding makes the same tokens
        again, so a pause costs compute, never a different answer."""
        self.tokens.clear()
        self.computed = self.cached_tokens = 0
        self.finish_reason = None
        self.admitted_at = self.first_token_at = None
        self.masked_steps = 0
        if self.constraint is not None:
            self.constraint.reset()
        self.restarts += 1
