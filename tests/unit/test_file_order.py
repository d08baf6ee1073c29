"""A key's file ids in a page's order, read a window at a time (producer/openai/file_order.py): the same
ids in the same order as sorting the whole listing, for any cursor, while a page of the newest reads
about its own files, not every file the key keeps (review, helper-115)."""

from __future__ import annotations

import bisect
import random
import time
from collections.abc import Iterator

import pytest

from producer.openai import file_order

FOLDER = "p/files/k/"
HOUR_MS = 3_600_000


class Listing:
    """S3's listing of one folder: ascending by key, from a StartAfter on; counts the keys it hands out."""

    def __init__(self, keys: list[str]) -> None:
        self.keys, self.read = sorted(keys), 0

    def __call__(self, prefix: str, start_after: str | None) -> Iterator[str]:
        at = bisect.bisect_right(self.keys, start_after) if start_after else 0
        for key in self.keys[at:]:
            if key.startswith(prefix):
                self.read += 1
                yield key


def _ids(ages_ms: list[int], seed: int) -> list[str]:
    rng, now = random.Random(seed), int(time.time() * 1000)
    return [f"file-{now - age:012x}{rng.getrandbits(64):016x}" for age in ages_ms]


def _listing(ids: list[str]) -> Listing:
    keys = [f"{FOLDER}{i}.{ext}" for i in ids for ext in ("json", "jsonl")]
    return Listing([*keys, "p/files/other/x.json"])


@pytest.mark.parametrize("seed", range(12))
def test_every_order_and_cursor_gives_what_sorting_the_whole_listing_gives(seed: int) -> None:
    rng = random.Random(seed)
    ages = [rng.choice([rng.randrange(HOUR_MS), rng.randrange(400 * 24 * HOUR_MS), 0]) for _ in range(60)]
    ids = _ids(ages + [ages[0]] * 3, seed)  # some in the same millisecond
    listing = _listing(ids)
    ordered = sorted(set(ids))
    cursors = [None, ordered[0], ordered[-1], *rng.sample(ordered, 5)]
    for cursor in cursors:
        want_desc = [i for i in reversed(ordered) if cursor is None or i < cursor]
        want_asc = [i for i in ordered if cursor is None or i > cursor]
        assert list(file_order.descending(listing, FOLDER, cursor)) == want_desc
        assert list(file_order.ascending(listing, FOLDER, cursor)) == want_asc


def test_no_files_and_one_file() -> None:
    assert list(file_order.descending(_listing([]), FOLDER, None)) == []
    (only,) = _ids([5], 1)
    assert list(file_order.descending(_listing([only]), FOLDER, None)) == [only]
    assert list(file_order.descending(_listing([only]), FOLDER, only)) == []


def test_a_page_of_the_newest_reads_about_its_own_files_not_all_the_keys() -> None:
    """1,000 files made over a year, one every ~9 hours: the newest 21 (a page of 20 and one more)
    are the last week's; reading them listed a few windows, not 2,000 keys."""
    ids = _ids([n * 9 * HOUR_MS for n in range(1000)], 7)
    listing = _listing(ids)
    walk = file_order.descending(listing, FOLDER, None)
    page = [next(walk) for _ in range(21)]
    assert page == sorted(ids, reverse=True)[:21]
    assert listing.read < 200, listing.read
    cursor, listing.read = page[19], 0  # the next page, from the cursor
    walk = file_order.descending(listing, FOLDER, cursor)
    assert [next(walk) for _ in range(21)] == sorted(ids, reverse=True)[20:41]
    assert listing.read < 300, listing.read


def test_a_page_of_a_burst_of_uploads_reads_its_last_minute_not_its_whole_hour() -> None:
    """Review, helper-118: the first window was an hour, so 300 files uploaded one a second were all
    read for every page of 10; an SDK's walk stayed quadratic."""
    ids = _ids([n * 1000 for n in range(300)], 11)
    listing = _listing(ids)
    walk = file_order.descending(listing, FOLDER, None)
    assert [next(walk) for _ in range(11)] == sorted(ids, reverse=True)[:11]
    assert listing.read < 200, listing.read  # 602 keys in the folder
