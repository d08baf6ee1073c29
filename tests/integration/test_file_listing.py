"""`GET /v1/files` pages against a real S3 endpoint (moto's server): the order and cursors of a listing
of the whole folder, read a window at a time (review, helper-115: every page listed every file the key
kept, so a page slowed as the key kept files, and an SDK's auto-paging walk was quadratic)."""

from __future__ import annotations

import io
import random
import time
from typing import Any

import pytest

from producer.client import Client
from producer.openai.files import Files
from shared.stores.s3 import S3Connection

pytestmark = pytest.mark.integration

HOUR_MS = 3_600_000


class CountingConnection(S3Connection):
    """The real connection, counting S3's listing calls and the keys they hand back."""

    calls = keys = 0

    def list_page(self, *args: Any, **kwargs: Any) -> Any:
        reply = super().list_page(*args, **kwargs)
        self.calls, self.keys = self.calls + 1, self.keys + len(reply.get("Contents", []))
        return reply


@pytest.mark.parametrize("whole_listing", [1000, 40], ids=["one-call", "windows"])
def test_pages_in_either_order_from_any_cursor(client: Client, whole_listing: int) -> None:
    """The same pages whether the folder fits one listing call (sorted in memory, one call) or not
    (read a window at a time: here 240 keys against 40 a call)."""
    settings = client.settings  # the fixture's AWS credentials are in the environment
    connection = CountingConnection(settings)
    files = Files(settings, connection)
    files.whole_listing, files.window_page = whole_listing, 10
    rng, now = random.Random(5), int(time.time() * 1000)
    owner = f"k{whole_listing}"
    ids = [f"file-{now - n * 9 * HOUR_MS:012x}{rng.getrandbits(64):016x}" for n in range(120)]
    for file_id in ids:
        files.create(owner, io.BytesIO(b'{"custom_id": "a"}\n'), "f.jsonl", "batch", file_id=file_id)
    files.create("other", io.BytesIO(b"{}\n"), "f.jsonl", "batch")  # another key's: never listed
    newest_first = sorted(ids, reverse=True)

    def walk(order: str, limit: int) -> list[str]:
        seen, after = [], None
        while True:
            page = files.list(owner, None, limit, order, after)
            seen += [item["id"] for item in page["data"]]
            if not page["has_more"]:
                return seen
            after = page["last_id"]

    assert walk("desc", 7) == newest_first
    assert walk("asc", 11) == newest_first[::-1]
    assert walk("desc", 1000) == newest_first
    connection.calls = connection.keys = 0
    page = files.list(owner, None, 5, "desc", None)
    assert [item["id"] for item in page["data"]] == newest_first[:5]
    if whole_listing == 1000:
        assert connection.calls == 1  # as before: one call, sorted here
    else:
        assert connection.keys < 100, connection.keys  # the newest few windows, not the 240 keys
    page = files.list(owner, None, 5, "desc", newest_first[50])
    assert [item["id"] for item in page["data"]] == newest_first[51:56]
    # a cursor that is no id of ours is placed among them all, as before
    assert [i["id"] for i in files.list(owner, None, 5, "desc", "zzz")["data"]] == newest_first[:5]
    assert files.list(owner, None, 5, "desc", "a")["data"] == []
    assert [i["id"] for i in files.list(owner, None, 3, "asc", "file-")["data"]] == newest_first[::-1][:3]
    assert files.list(owner, "batch_output", 5, "desc", None)["data"] == []


def test_a_key_with_no_files_lists_none(client: Client) -> None:
    files = Files(client.settings, S3Connection(client.settings))
    files.whole_listing = 2
    assert files.list("nobody", None, 20, "desc", None)["data"] == []
    assert files.list("nobody", None, 20, "asc", "file-0")["data"] == []
