"""Streamed answers: a streaming row's text, published as it is decoded, for mrc-api to relay.

The engine's thread only hands over a copy of a streaming row's tokens after each step (`offer`, a
dict write under a lock: it never waits for Redis). This module's own thread wakes at most every
MRC_STREAM_INTERVAL_S (at once for a row's first text and its end), decodes each offered row's
tokens to text, and writes what is new of every streaming row in one Redis round trip: one XADD per
row with new text (and an EXPIRE the first time), so Redis commands per streamed token fall as rows
and steps grow, never one per row per step.

An entry is `at` (where its text starts in the answer), `t` (the text) and `m` (the model's name as
the result will give it: mrc-api names the model in every chunk with it, where a name asked for,
`tiny` say, is not the name served); the row's end adds `end`.
A row paused or restarted makes the same greedy tokens again: nothing is published twice, since only
text past what was published goes out. A redelivered job (its worker died) starts from nothing on
another worker, whose entries start again at 0: mrc-api relays only what lies past what it sent.
What is published is a prefix of the answer as the result will hold it: a trailing run of byte
tokens is held back until a token that is not one ends it (a byte-fallback decoder writes a run that
turns out not to be UTF-8 as U+FFFD, every byte of it, the valid ones before included), so is a
trailing partial character, and so is the last word when the tokenizer cleans spaces up (`" ,"` ->
`","`).
The stream is a courtesy to a waiting client, the result object is the answer: a Redis failure here
is logged once and retried at the next flush, and never touches the row.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared import logs, names

_REPLACEMENT = "\ufffd"  # what a partial UTF-8 character decodes to until its last byte comes


class Sink(Protocol):
    def write(self, entries: list[Entry], fresh: set[str]) -> None:
        """Append the entries (in order), in one round trip; `fresh`: jobs written for the first time."""


@dataclass
class Entry:
    job_id: str
    at: int
    text: str
    end: bool = False


@dataclass
class _Row:
    tokens: list[int]
    ended: bool = False


@dataclass
class _Published:
    chars: int = 0
    started: bool = False


def stable_text(text: str, cleans_spaces: bool) -> str:
    """The part of `text` (the decode of a row's tokens so far) that later tokens cannot change."""
    text = text.rstrip(_REPLACEMENT)
    if cleans_spaces:  # " ." -> "." and the like: a space may yet vanish; hold back from the last one
        cut = max(text.rfind(" "), text.rfind("\n"), text.rfind("\t"))
        if cut >= 0:
            text = text[:cut]
    return text


class RedisSink:
    """Each job's entries into its Redis stream (shared/names.stream_key), capped and expiring."""

    MAX_ENTRIES = 2048  # ~ approximate trim: a stream never holds more than about this many

    def __init__(self, client: Any, ttl_s: int, model: str = "") -> None:
        self._redis, self.ttl_s, self.model = client, ttl_s, model

    def write(self, entries: list[Entry], fresh: set[str]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for entry in entries:
            key = names.stream_key(entry.job_id)
            fields: dict[str, Any] = {"at": entry.at, "t": entry.text}
            if entry.end:
                fields["end"] = 1
            if self.model:  # on every entry: a stream trimmed of its first still names the model
                fields["m"] = self.model
            pipe.xadd(key, fields, maxlen=self.MAX_ENTRIES, approximate=True)
            if entry.job_id in fresh or entry.end:
                pipe.expire(key, self.ttl_s)
        pipe.execute()


@dataclass
class MemorySink:
    """Entries kept in a list (tests, and a worker without Redis)."""

    entries: list[Entry] = field(default_factory=list)

    def write(self, entries: list[Entry], fresh: set[str]) -> None:
        self.entries.extend(entries)

    def text(self, job_id: str) -> str:
        out = ""
        for entry in self.entries:
            if entry.job_id == job_id and entry.at <= len(out):
                out = out[: entry.at] + entry.text
        return out


class TextStreams:
    """The publisher: rows' tokens in (`offer`, from the engine's thread), text out through a Sink."""

    def __init__(
        self,
        sink: Sink,
        detokenize: Callable[[list[int]], str],
        interval_s: float,
        cleans_spaces: bool = False,
        settled: Callable[[list[int]], int] = len,
    ) -> None:
        self.sink, self.detokenize, self.interval_s = sink, detokenize, interval_s
        self.cleans_spaces, self.settled = cleans_spaces, settled
        self._offered: dict[str, _Row] = {}
        self._published: dict[str, _Published] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._urgent = False  # a first text or an end is waiting: flush without waiting the interval
        self._failing = False
        self.flushes = 0
        self._thread = threading.Thread(target=self._loop, name="mrc-streams", daemon=True)

    def start(self) -> TextStreams:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def offer(self, job_id: str, tokens: list[int], ended: bool = False) -> None:
        """A streaming row's tokens now (copied); `ended`: the row is done, its stream is closed."""
        with self._cond:
            row = self._offered.get(job_id)
            if row is not None and row.ended:
                return  # a later row of the same job (a second delivery) writes its own end
            self._offered[job_id] = _Row(list(tokens), ended)
            # A row's first text and its end go out at once (a ticket's first words, the client's
            # answer); what comes between waits for the interval, gathered.
            if ended or job_id not in self._published:
                self._urgent = True
            self._cond.notify()

    def flush(self) -> None:
        """Publish what was offered since the last flush (the thread's loop; tests call it directly)."""
        with self._cond:
            offered, self._offered = self._offered, {}
            self._urgent = False
        if not offered:
            return
        entries, fresh = self._entries(offered)
        if not entries:
            return
        try:
            self.sink.write(entries, fresh)
        except Exception as exc:  # the answer does not depend on it: offer again at the next flush
            if not self._failing:
                logs.get_logger().warning("MRC_STREAM_PUBLISH_FAILED", error=repr(exc)[:300])
            self._failing = True
            with self._cond:
                for job_id, row in offered.items():
                    self._offered.setdefault(job_id, row)
            return
        self._failing = False
        self.flushes += 1
        for entry in entries:
            published = self._published.setdefault(entry.job_id, _Published())
            published.started = True
            published.chars = entry.at + len(entry.text)
            if entry.end:
                del self._published[entry.job_id]

    def _entries(self, offered: dict[str, _Row]) -> tuple[list[Entry], set[str]]:
        entries: list[Entry] = []
        fresh: set[str] = set()
        for job_id, row in offered.items():
            published = self._published.get(job_id, _Published())
            if row.ended:
                text = self.detokenize(row.tokens)
            else:
                settled = row.tokens[: self.settled(row.tokens)]
                text = stable_text(self.detokenize(settled), self.cleans_spaces)
            if len(text) <= published.chars and not row.ended:
                continue  # a restarted row making its tokens again, or a held-back tail
            entries.append(Entry(job_id, published.chars, text[published.chars :], row.ended))
            if not published.started:
                fresh.add(job_id)
        return entries, fresh

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._offered and not self._stopping:
                    self._cond.wait()
                stopping = self._stopping
            self.flush()
            if stopping:
                return
            # Coalesce: the rows' next tokens gather for one interval (only a first text or an end
            # cuts it short).
            deadline = time.monotonic() + self.interval_s
            with self._cond:
                while not self._stopping and not self._urgent and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
