"""Each job's grammar as the model stage asks for it: without waiting (issue 36, item 9).

A job with a `response_format` asks as soon as its delivery is in hand; a grammar kept from an earlier
job is there at once, any other compiles on workers/grammar_compiles.py's threads while the delivery
decodes images and hands its other jobs to the engine. The stage settles each ask when the job's model
inputs are ready: a row state (workers/grammar.py's Constraint), None for a free answer, the job's own
error, or how long to wait before looking again.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from shared import schema_bounds
from shared.errors import CompilerBusy, InvalidJob, MrcError
from shared.response_format import ChoiceFormat, JsonSchemaFormat, digest
from workers.grammar import RAN_OUT_KEEP_S, CompileTimedOut
from workers.grammar_compiles import Compiles, Wait
from workers.metrics import Metrics

Format = JsonSchemaFormat | ChoiceFormat
# What an ask settles to: a row state, None (a free answer), the job's error, or seconds to wait.
Settled = Any


@dataclass(eq=False)
class Ask:
    """One job's grammar: settled already (`value`) or being compiled (`wait`)."""

    fmt: Format | None
    value: Any = None  # a Constraint, None (free), or an MrcError
    wait: Wait | None = None

    @property
    def future(self) -> Future[Any] | None:
        """What ends when the compile does (None when nothing is compiling for this job)."""
        return None if self.wait is None else self.wait.compile.future


class RowGrammars:
    def __init__(
        self, backend: Any, limit_s: float, metrics: Metrics, compiles: Compiles | None = None
    ) -> None:
        self.grammars = getattr(backend, "grammars", None)
        self.model_id = str(backend.model_id)
        self.limit_s, self.metrics = limit_s, metrics
        self.compiles = compiles or Compiles(limit_s)

    def ask(self, fmt: Format | None, owner: str | None = None) -> Ask:
        """Start what this job's grammar needs; never waits for a compile. `owner`: the job's API key,
        whose compiles take turns with other keys' (workers/grammar_compiles.py)."""
        if fmt is None:
            return Ask(None)
        if self.grammars is None:
            return Ask(fmt, InvalidJob(f"the model backend {self.model_id!r} cannot constrain answers"))
        compiled = self.grammars.cached(fmt, owner or "")
        self.metrics.grammar_cache.labels(result="hit" if compiled is not None else "miss").inc()
        if compiled is not None:
            return Ask(fmt, self._matcher(compiled))
        may_be_slow = getattr(self.grammars, "may_be_slow", None)
        light = may_be_slow is not None and not may_be_slow(fmt)
        # A compile under way is joined by the same key's jobs only: another key's waits its own turn.
        key = f"{owner or ''}|{digest(fmt)}"  # the digest's fixed length keeps the pair apart
        return Ask(
            fmt, wait=self.compiles.request(key, lambda: self._compile(fmt, owner or ""), owner or "", light)
        )

    def settle(self, ask: Ask) -> Settled:
        """The row state, None (free), the job's error, or (a float) seconds before looking again."""
        if ask.wait is None:
            return ask.value
        verdict = self.compiles.poll(ask.wait)
        if verdict.state == "waiting":
            return verdict.wait_s
        if verdict.state == "done":
            try:
                return self._matcher(ask.wait.compile.future.result())
            except CompileTimedOut as stopped:  # at the limit (workers/grammar_fork.py), or lately
                return self._too_costly(ask, lately=stopped.lately)
            except MrcError as exc:  # does not compile, allows no answer: the format's own fault
                return exc
            except Exception as exc:  # anything else the library raised is the job's, never the delivery's
                return InvalidJob(f"response_format does not compile to a grammar: {str(exc)[:300]}")
        if verdict.state == "busy":
            return CompilerBusy(
                f"the grammar compiler was busy with other formats past their {self.limit_s:g} s limit "
                "(MRC_GRAMMAR_COMPILE_TIMEOUT_S); the job is retried"
            )
        return self._too_costly(ask)

    def _too_costly(self, ask: Ask, lately: bool = False) -> InvalidJob:
        if lately:  # nothing compiled for this job: say so, and for how long the format is refused
            return InvalidJob(
                f"{self._where(ask.fmt)}: this format's grammar was stopped at the "
                f"{self.limit_s:g} s limit (MRC_GRAMMAR_COMPILE_TIMEOUT_S) less than "
                f"{RAN_OUT_KEEP_S:g} s ago, and is refused until then without a new compile: lower "
                "the bounds of its repeats (or split the schema)"
            )
        return InvalidJob(
            f"{self._where(ask.fmt)}: its grammar did not compile within {self.limit_s:g} s "
            "(MRC_GRAMMAR_COMPILE_TIMEOUT_S): lower the bounds of its repeats (or split the schema)"
        )

    def forget(self, ask: Ask) -> None:
        """The job no longer needs its grammar (it failed first): its compile, if nobody else waits for
        it and it has not started, is dropped."""
        if ask.wait is not None:
            self.compiles.give_up(ask.wait)

    def _compile(self, fmt: Format, owner: str) -> Any:
        """On a compile thread: compile, keep (the next job of this format finds it), measure."""
        assert self.grammars is not None
        compiled, seconds = self.grammars.compile_and_keep(fmt, owner)
        self.metrics.grammar_compile.labels(type=fmt.type).observe(seconds)
        return compiled

    def _matcher(self, compiled: Any) -> Any:
        assert self.grammars is not None
        return self.grammars.matcher(compiled)

    @staticmethod
    def _where(fmt: Format | None) -> str:
        if isinstance(fmt, JsonSchemaFormat):
            return schema_bounds.costliest(fmt.schema_)
        return "response_format.choices" if isinstance(fmt, ChoiceFormat) else "response_format"
