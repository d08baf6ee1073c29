"""Structured answers on the worker: a grammar per response format (xgrammar), compiled once per
format and kept by its hash, and one matcher per row that says, at every decode step, which tokens
may come next (docs/design.md says why xgrammar).

The producer checked the format without torch (shared/response_format.py); this compiles it again
against the model's own vocabulary, and a format that does not compile fails its job alone
(`invalid_job`). The engine asks each constrained row for its mask (workers/engine/masks.py); free
rows are never touched.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any

from shared import schema_bounds
from shared.errors import CompileInterrupted, InvalidJob, ModelError
from shared.response_format import ChoiceFormat, JsonSchemaFormat, digest
from workers import grammar_fork
from workers.utf8_guard import Utf8Guard

RAN_OUT_KEEP_S = 300.0  # a format whose compile was stopped is refused at once this long after
# Patterns spelled out to at most this many characters (all of a schema's, summed) compile in the
# caller's thread: 2,048 took 0.2 s (docs/benchmarks.md, "Grammar compile against a pattern's repeat"),
# less than a fork of a large worker costs. Past it, in a child that is stopped at the limit.
IN_THREAD_SPELLED = 2048


class CompileTimedOut(InvalidJob):
    """The format's grammar did not compile within its limit (the caller names the format's place).
    `lately`: this job compiled nothing; the format's compile was stopped less than RAN_OUT_KEEP_S ago
    (review, helper-86: the job was told its grammar "did not compile within 10 s" in 0.3 s)."""

    def __init__(self, message: str, lately: bool = False) -> None:
        super().__init__(message)
        self.lately = lately


class Constraint:
    """One row's grammar state: which tokens may follow what it has generated so far."""

    def __init__(self, matcher: Any, vocab_size: int, guard: Utf8Guard | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.guard = guard
        # The guard's mask row for the next token (workers/utf8_guard.py): only valid UTF-8.
        self.keep: Any = None if guard is None else guard.always

    def accept(self, token: int) -> None:
        # The mask allowed only tokens the grammar accepts, so a refusal is a fault in the mask's
        # application (a wrong vocabulary size, a mask applied to the wrong row), not the job's.
        if not self.matcher.accept_token(token):
            raise ModelError(f"the grammar refused token {token}, which its own mask allowed")
        if self.guard is not None:
            self.keep = self.guard.keep_after(token)

    @property
    def complete(self) -> bool:
        """The answer so far is a whole answer (the grammar's root is matched)."""
        return bool(self.matcher.is_completed())

    def only_end_left(self, eos_id: int) -> bool:
        """The answer is whole and nothing may follow it but end-of-text: the next step's token is
        forced, so the row ends now, `stop` (a whole answer at exactly max_new_tokens ended `length`,
        and the SDKs' `parse` refuses that; every constrained row spent one more step for it)."""
        if not self.matcher.is_completed():
            return False
        from xgrammar import allocate_token_bitmask

        mask = allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(mask)
        word, bit = divmod(eos_id, 32)
        return int(mask[0, word]) & 0xFFFFFFFF == 1 << bit and int((mask != 0).sum()) == 1

    def reset(self) -> None:
        """Back to an empty answer (the row is recomputed from its prompt)."""
        self.matcher.reset()
        self.keep = None if self.guard is None else self.guard.always


class Grammars:
    """The compiler for one model's vocabulary, and the compiled grammars it keeps (LRU, bounded), per
    API key as the result and prefix caches are: shared, a key's first job of a format ran seconds
    sooner when another key had sent that format, which told it so."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_id: int,
        keep: int,
        threads: int = 1,
        limit_s: float | None = None,
        keep_bytes: int | None = None,
    ) -> None:
        """`limit_s`: a compile that could be slow (`_may_be_slow`) runs in a forked child stopped past
        it (workers/grammar_fork.py); None compiles every format on the caller's thread. `keep`
        grammars at most, and at most `keep_bytes` of them (the newest is kept whatever its size): at
        a vocabulary of 262,144 tokens a compiled grammar took 0.45-1.45 MB here and more for larger
        schemas, so a bound by count alone let 256 of them hold up to a gigabyte (review, helper-115)."""
        import xgrammar

        self._xgr = xgrammar
        # The model's vocabulary can be larger than the tokenizer's (padded embeddings): ids past the
        # tokenizer's are never allowed. End-of-text is the one stop token: it ends a complete answer.
        self.info = tokenizer_info(tokenizer, vocab_size, eos_id)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.guard = Utf8Guard(self.info.decoded_vocab, vocab_size)
        self.vocab_size = vocab_size
        self.keep, self.limit_s, self.keep_bytes = keep, limit_s, keep_bytes
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()  # (API key, format hash)
        self._sizes: dict[tuple[str, str], int] = {}  # the same keys: each grammar's bytes
        # (API key, format hash) -> when its compile was stopped: per key, as the result cache is (review,
        # helper-87: shared, it told a key that another had sent that exact schema in the last 5 minutes)
        self._ran_out: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def longest_token_chars(self) -> int:
        """The most characters one token the grammar may allow decodes to (specials are empty, never
        allowed): with max_new_tokens it bounds an answer's length, which the producer assumes is at
        most MRC_MAX_TOKEN_CHARS (shared/schema_bounds.py)."""
        pieces = self.info.decoded_vocab
        return max((len(bytes(piece).decode("utf-8", "replace")) for piece in pieces), default=0)

    def constraint(self, fmt: JsonSchemaFormat | ChoiceFormat) -> tuple[Constraint, float | None]:
        """A fresh row state for this format, and the seconds its compile took (None: cached). Compiles
        here, on the caller's thread: the worker's delivery path asks through workers/grammar_compiles.py
        instead, which compiles off it with a time limit."""
        compiled = self.cached(fmt)
        if compiled is not None:
            return self.matcher(compiled), None
        compiled, seconds = self.compile_and_keep(fmt)
        return self.matcher(compiled), seconds

    def matcher(self, compiled: Any) -> Constraint:
        """A fresh row state over a compiled grammar."""
        return Constraint(self._xgr.GrammarMatcher(compiled), self.vocab_size, self.guard)

    def cached(self, fmt: JsonSchemaFormat | ChoiceFormat, owner: str = "") -> Any | None:
        """The compiled grammar kept for this format (by its canonical hash) and key, or None."""
        key = (owner, digest(fmt))
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        return None

    def compile_and_keep(self, fmt: JsonSchemaFormat | ChoiceFormat, owner: str = "") -> tuple[Any, float]:
        """Compile (InvalidJob when it does not), keep it for `owner`, and say how many seconds it took.
        `owner`: the API key asking (its grammars, and its formats stopped at the limit, are its own)."""
        began = time.perf_counter()
        compiled = self.compile(fmt, owner)
        seconds = time.perf_counter() - began
        with self._lock:
            key = (owner, digest(fmt))
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            self._sizes[key] = int(getattr(compiled, "memory_size_bytes", 0))
            while len(self._compiled) > self.keep:
                self._evict_one(by_bytes=False)
            while len(self._compiled) > 1 and self.held_bytes > (self.keep_bytes or self.held_bytes):
                self._evict_one(by_bytes=True)
        return compiled, seconds

    @property
    def held_bytes(self) -> int:
        """What the kept grammars take, as the library counts it."""
        return sum(self._sizes.values())

    def _evict_one(self, by_bytes: bool) -> None:
        """Drop the least recently used grammar of the key holding the most (grammars, or bytes): one
        key sending format after format then evicts its own, not every other key's (whose next jobs
        would each wait a compile again, seconds for a costly one). Never the newest."""
        held: dict[str, int] = {}
        for key in self._compiled:
            held[key[0]] = held.get(key[0], 0) + (self._sizes[key] if by_bytes else 1)
        newest = next(reversed(self._compiled))
        # max() keeps the first of equals: in LRU order, the heaviest key's least recently used
        oldest = max((key for key in self._compiled if key != newest), key=lambda key: held[key[0]])
        del self._compiled[oldest], self._sizes[oldest]

    def compile(self, fmt: JsonSchemaFormat | ChoiceFormat, owner: str = "") -> Any:
        """The compiled grammar; InvalidJob when it does not compile, admits no answer, or (with
        `limit_s`) did not compile within it: CompileTimedOut, also at once for RAN_OUT_KEEP_S after."""
        try:
            if self.limit_s is None:
                compiled = self._compile(fmt)
            else:
                compiled = self._compile_within(fmt, self.limit_s, owner)
        except (InvalidJob, CompileInterrupted):  # the format's fault, or the worker's: as they are
            raise
        except Exception as exc:  # the library's errors are RuntimeError/ValueError with its reason
            raise InvalidJob(f"response_format does not compile to a grammar: {str(exc)[:300]}") from None
        if not self._any_first_token(compiled):
            raise InvalidJob("response_format allows no answer: its grammar admits no first token")
        return compiled

    def _compile(self, fmt: JsonSchemaFormat | ChoiceFormat, compiler: Any = None) -> Any:
        compiler = compiler or self.compiler
        if isinstance(fmt, ChoiceFormat):
            return compiler.compile_grammar(choice_ebnf(fmt.choices))
        # No free whitespace: a weak model would otherwise pad the answer with spaces until its token
        # limit. Separators are JSON's usual ", " and ": ".
        grammar = self._xgr.Grammar.from_json_schema(json.dumps(fmt.schema_), any_whitespace=False)
        return compiler.compile_grammar(strict_strings(str(grammar)))

    def may_be_slow(self, fmt: JsonSchemaFormat | ChoiceFormat) -> bool:
        """Whether this format's compile could take long (then it holds one of the compile places)."""
        return _may_be_slow(fmt)

    def _compile_within(self, fmt: JsonSchemaFormat | ChoiceFormat, limit_s: float, owner: str) -> Any:
        """Compiled in a forked child stopped at `limit_s` (workers/grammar_fork.py); here when no child
        can be made. A format stopped is refused at once for RAN_OUT_KEEP_S: its next job would spend
        the same seconds of a compile place to the same end."""
        if not _may_be_slow(fmt):
            return self._compile(fmt)
        key = (owner, digest(fmt))
        with self._lock:
            stopped = self._ran_out.get(key)
            if stopped is not None and time.monotonic() - stopped > RAN_OUT_KEEP_S:
                del self._ran_out[key]
                stopped = None
        if stopped is not None:
            raise CompileTimedOut(f"stopped at {limit_s:g} s less than {RAN_OUT_KEEP_S:g} s ago", lately=True)

        def in_child() -> str:  # a compiler of its own: none a parent thread may hold mid-compile
            own = self._xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
            return str(self._compile(fmt, own).serialize_json())

        try:
            text = grammar_fork.run(in_child, limit_s)
        except OSError:  # no process to be had (a limit on processes, memory): compiled here
            return self._compile(fmt)
        except grammar_fork.ChildFailed as failed:
            raise InvalidJob(f"response_format does not compile to a grammar: {str(failed)[:300]}") from None
        except grammar_fork.ChildDied as died:  # review, helper-85: an OOM kill blamed the format
            raise CompileInterrupted(
                f"the grammar's compile was interrupted: {died}; the job is retried"
            ) from None
        except grammar_fork.TimedOut:
            with self._lock:
                self._ran_out[key] = time.monotonic()
                while len(self._ran_out) > max(self.keep, 1):
                    self._ran_out.popitem(last=False)
            raise CompileTimedOut(f"stopped at {limit_s:g} s") from None
        return self._xgr.CompiledGrammar.deserialize_json(text, self.info)

    def _any_first_token(self, compiled: Any) -> bool:
        """Whether an answer can start at all (a grammar dead at its start, e.g. a $ref cycle with no
        way out, fails its job here rather than at its first decode step)."""
        mask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
        return bool((mask != 0).any())


def _may_be_slow(fmt: JsonSchemaFormat | ChoiceFormat) -> bool:
    """Whether the format's compile could outlast a fork's cost by far: patterns whose repeats the
    library spells out past IN_THREAD_SPELLED. Anything else compiles in milliseconds (choices,
    maxLength of any size, hundreds of properties, thousands of enum values: measured, review)."""
    if isinstance(fmt, ChoiceFormat):
        return False
    try:
        return schema_bounds.spelled_out_total(fmt.schema_) > IN_THREAD_SPELLED
    except Exception:  # a pattern the reader refuses: the library judges it, in a child
        return True


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_id: int) -> Any:
    """The vocabulary as the grammar sees it. The library reads the tokenizer's special tokens
    (`<pad>`, `<s>`, `<unk>`) as text ("<pad>" is five characters to it) while detokenizing drops
    them: an answer holding one parsed in the grammar and not in the result (tests/unit/
    test_schema_rules.py found a string one character short). Every special token but end-of-text is
    made empty here, which the library treats as never allowed."""
    import xgrammar

    found = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos_id])
    vocab = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size:
            vocab[index] = token
    for index in getattr(tokenizer, "all_special_ids", []):
        if index != eos_id and 0 <= index < vocab_size:
            vocab[index] = ""
    return xgrammar.TokenizerInfo(
        vocab,
        vocab_type=found.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=[eos_id],
        add_prefix_space=found.add_prefix_space,
    )


# xgrammar 0.2.9 writes the characters of a length-bounded string as [^"\\\r\n]: raw control
# characters (U+0000-U+001F, which JSON requires escaped) pass, and a strict JSON parser then refuses
# the answer (tests/unit/test_structured.py found it). Its unbounded strings exclude them; bounded ones
# are narrowed to the same here (no escapes inside them: a smaller set of valid strings, never an
# invalid one).
_LOOSE_CHARACTERS = r"[^\"\\\r\n]"
_STRICT_CHARACTERS = r"[^\0-\x1f\"\\]"


def strict_strings(ebnf: str) -> str:
    return ebnf.replace(_LOOSE_CHARACTERS, _STRICT_CHARACTERS)


def choice_ebnf(choices: list[str]) -> str:
    """A grammar whose sentences are exactly the choices, each written as an EBNF string literal."""
    return "root ::= " + " | ".join(_literal(choice) for choice in choices)


def _literal(text: str) -> str:
    # JSON string escapes are the EBNF literal's own (\", \\, \uXXXX); characters beyond the Basic
    # Multilingual Plane stay as themselves, never as a surrogate pair the grammar would not match.
    return json.dumps(text, ensure_ascii=False)
