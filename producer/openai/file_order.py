"""A large folder's file ids in the order a `GET /v1/files` page asks for, read a window at a time.

File ids begin with their creation's milliseconds in fixed-width hex (`files.new_file_id`), so S3's
one order, ascending by key, is their age. Oldest first is one listing from the cursor on. Newest first
(the default) lists windows of time back from the cursor, each ascending and given back reversed, each
four times as long as the last: a page costs about the files it shows, where a listing of the key's
whole folder at every request cost time in proportion to all the files it keeps (review, helper-115:
a page took four times as long at 1,000 files as at a dozen, and an SDK's auto-paging walk was
quadratic)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator

# `file-` + 12 hex digits of milliseconds + the random part
_TIMED = re.compile(r"^file-([0-9a-f]{12})[0-9a-f]*\Z")
_FIRST_SPAN_MS = 60_000  # a minute: a burst of uploads (one a second) is not read whole for a page

# (key prefix, start after this key or None) -> the keys from there on, ascending
Lister = Callable[[str, str | None], Iterator[str]]


def timed(file_id: str) -> bool:
    return _TIMED.match(file_id) is not None


def ascending(keys: Lister, folder: str, after: str | None) -> Iterator[str]:
    """The ids after `after` (all without it), oldest first."""
    yield from _ids(keys, folder, f"{folder}{after}.json" if after else None, after)


def descending(keys: Lister, folder: str, before: str | None, oldest: str | None = None) -> Iterator[str]:
    """The ids before `before` (all without it), newest first; `before` a timed id or None. `oldest`:
    the folder's first id where the caller has listed it already."""
    oldest = oldest or next(_ids(keys, folder, None, None), None)
    if oldest is None:
        return
    floor_ms = _ms(oldest)
    high = before  # the window's end, not in it; None: none
    high_ms = _ms(before) if before is not None else int(time.time() * 1000)
    span = _FIRST_SPAN_MS
    while True:
        low_ms = max(floor_ms, high_ms - span)
        # every id of low_ms or later sorts after `start`; None: from the oldest
        start = None if low_ms <= floor_ms else f"{folder}file-{low_ms:012x}"
        window = []
        for file_id in _ids(keys, folder, start, None):
            if high is not None and file_id >= high:
                break
            window.append(file_id)
        yield from reversed(window)
        if start is None:
            return
        high, high_ms, span = f"file-{low_ms:012x}", low_ms, span * 4


def ids_of(folder: str, keys: Iterable[str]) -> Iterator[str]:
    """The file ids of a listing's keys: one per description (`<id>.json`)."""
    for key in keys:
        if key.startswith(folder) and key.endswith(".json"):
            yield key[len(folder) : -len(".json")]


def _ids(keys: Lister, folder: str, start_after: str | None, after: str | None) -> Iterator[str]:
    """The ids listed from `start_after` on, past `after`."""
    for file_id in ids_of(folder, keys(folder, start_after)):
        if after is None or file_id > after:
            yield file_id


def _ms(file_id: str) -> int:
    found = _TIMED.match(file_id)
    return int(found.group(1), 16) if found else 0
