"""One chunk's index while a pass queues it (producer/backlog/run.py).

The whole index, `runs/<run_id>/index/<chunk>.jsonl`, is written once the chunk is queued: it is what a
resume trusts (an indexed chunk is gone over, not queued again) and what the run's counts in Redis were
added for. A chunk queued slowly (`--rate`, or waiting for room on a full lane) also has a partial
index beside it, `<chunk>.partial.jsonl`, rewritten every few seconds while it grows and at once when
the lane fills, so `status`, `report` and `cancel` see its jobs as they are queued (review, helper-72:
a `--rate` run read 0/0 for its whole first chunk of 5,000 lines). A partial index is for readers only:
a resume ignores it and queues the chunk as if it had none (a job already recorded is never queued
twice), its lines are not counted until the whole index is written, and it is deleted then.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from shared import encoding
from shared.stores import RunFiles

WHOLE, PARTIAL = ".jsonl", ".partial.jsonl"
PARTIAL_EVERY_S = 2.0  # how stale a growing chunk's partial index may get


def key_of(folder: str, chunk: int, partial: bool = False) -> str:
    """A chunk's index key under `folder` (`runs/<run_id>/index/`); zero-padded, so a listing returns
    the chunks in manifest order, a chunk's whole index before its partial one."""
    return f"{folder}{chunk:08d}{PARTIAL if partial else WHOLE}"


def chunk_number(key: str) -> int:
    """The chunk an index object is for (`.../index/00000012.jsonl` -> 12, and its `.partial.jsonl`)."""
    return int(key.rsplit("/", 1)[-1].split(".", 1)[0])


def listed(keys: Iterable[str]) -> tuple[set[int], set[int]]:
    """(chunks with a whole index, chunks with a partial one) of an index folder's listing."""
    whole: set[int] = set()
    partial: set[int] = set()
    for key in keys:
        (partial if key.endswith(PARTIAL) else whole).add(chunk_number(key))
    return whole, partial


def readable(keys: Iterable[str]) -> Iterator[str]:
    """The index objects a reader reads, in manifest order: a chunk's whole index, else its partial one
    (both exist only between a whole index's write and its partial's delete)."""
    last_whole = -1
    for key in keys:
        number = chunk_number(key)
        if key.endswith(PARTIAL):
            if number != last_whole:
                yield key
        else:
            last_whole = number
            yield key


def entries_of(text: str) -> list[dict[str, Any]]:
    """An index object's entries. JSONL: a line ends at "\\n" only (U+2028 is text)."""
    return [json.loads(row) for row in text.split("\n") if row.strip()]


class ChunkIndex:
    """The entries of one chunk as a pass queues it: `entries` (this pass's, appended as lines are
    checked and queued), over `known` (what an earlier pass indexed) and `earlier` (entries of lines
    this pass queues again; each stays until its line has a new one)."""

    def __init__(
        self,
        files: RunFiles,
        folder: str,
        number: int,
        known: list[dict[str, Any]] | None = None,
        earlier: list[dict[str, Any]] | None = None,
        stale_partial: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.files, self.number = files, number
        self.whole_key, self.partial_key = key_of(folder, number), key_of(folder, number, partial=True)
        self.known, self.earlier = known or [], earlier or []
        self.entries: list[dict[str, Any]] = []
        self._partial_exists = stale_partial  # one a killed pass left: deleted with the whole write
        self._clock = clock
        self._written_at = clock()
        self._written_count = 0

    def kept(self) -> list[dict[str, Any]]:
        """This pass's entries, and those of `earlier` whose line has none yet."""
        done = {int(e["line"]) for e in self.entries}
        return [*self.entries, *(e for e in self.earlier if int(e["line"]) not in done)]

    def all(self) -> list[dict[str, Any]]:
        """Every entry of the chunk, in manifest order."""
        return sorted([*self.known, *self.kept()], key=lambda e: int(e["line"]))

    def grew(self, waiting: bool = False) -> None:
        """Entries were added: the partial index is rewritten if it is older than PARTIAL_EVERY_S, or
        at once when the pass is about to wait for room (it may wait for hours)."""
        if len(self.entries) == self._written_count:
            return
        if waiting or self._clock() - self._written_at >= PARTIAL_EVERY_S:
            self.files.put_text(self.partial_key, _body(self.all()))
            self._partial_exists = True
            self._written_at, self._written_count = self._clock(), len(self.entries)

    def write(self) -> list[dict[str, Any]]:
        """The whole index; returns its entries."""
        indexed = self.all()
        self.files.put_text(self.whole_key, _body(indexed))
        if self._partial_exists:
            self.files.delete(self.partial_key)
            self._partial_exists = False
        return indexed


def _body(entries: list[dict[str, Any]]) -> str:
    return "".join(encoding.to_text(e) + "\n" for e in entries)
