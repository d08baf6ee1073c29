"""`GET /v1/files` pages as a key keeps more files: a page of the newest, a page from the middle of the
list, the ids alone (the listing calls, no descriptions read), and a walk of every page (an SDK's
auto-paging), the folder read a window of time at a time (now) against the whole folder listed at
every page (before).

Real moto S3 server; N files made one every ~9 hours back from now (ids carry their milliseconds).
moto's listing reads the whole bucket at every call whatever its StartAfter, so here a call costs the
same however few keys it returns; S3's costs by the keys it returns.

    .venv/bin/python tests/bench/bench_file_listing.py [--files 1500] [--limit 20]
"""

from __future__ import annotations

import argparse
import io
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set

HOUR_MS = 3_600_000


def whole_folder(files: Any) -> Any:
    """The listing before: the key's whole folder at every page, sorted here."""
    from producer.openai import file_order

    def ordered(folder: str, order: str, after: str | None) -> Iterator[str]:
        ids = sorted(file_order.ids_of(folder, files._keys(folder)), reverse=order == "desc")
        return iter([i for i in ids if after is None or (i < after if order == "desc" else i > after)])

    return ordered


def median_s(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def walk_s(files: Any, limit: int, expected: list[str]) -> float:
    began, after, seen = time.perf_counter(), None, []
    while True:
        page = files.list("k", None, limit, "desc", after)
        seen += [item["id"] for item in page["data"]]
        if not page["has_more"]:
            assert seen == expected, "a walk that missed or repeated files"
            return time.perf_counter() - began
        after = page["last_id"]


def main() -> None:
    parser = argparse.ArgumentParser(description="GET /v1/files pages, windows against the whole folder")
    parser.add_argument("--files", type=int, default=1500)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logs.configure("WARNING")
    with services.local_stack("mrc-bench-files-", "mrc-bench", ROOT / ".cache" / "mrc") as env:
        from producer.openai.files import Files
        from shared.stores.s3 import S3Connection

        settings = services.settings_from_env(env)
        now, before = Files(settings, S3Connection(settings)), Files(settings, S3Connection(settings))
        before._ordered = whole_folder(before)  # type: ignore[method-assign]
        rng, now_ms = random.Random(3), int(time.time() * 1000)
        ids = [f"file-{now_ms - n * 9 * HOUR_MS:012x}{rng.getrandbits(64):016x}" for n in range(args.files)]
        began = time.perf_counter()
        for file_id in ids:
            now.create("k", io.BytesIO(b'{"custom_id": "a"}\n'), "f.jsonl", "batch", file_id=file_id)
        print(f"{args.files} files made in {time.perf_counter() - began:.1f} s")
        newest = sorted(ids, reverse=True)
        middle = newest[args.files // 2]
        folder = f"{settings.s3_prefix}files/k/"
        rows: list[tuple[str, Callable[[Any], object]]] = [
            ("a page of the newest", lambda f: f.list("k", None, args.limit, "desc", None)),
            ("a page from the middle", lambda f: f.list("k", None, args.limit, "desc", middle)),
            ("ids alone, the newest", lambda f: list(itertools.islice(f._ordered(folder, "desc", None), 21))),
            (
                "ids alone, the middle",
                lambda f: list(itertools.islice(f._ordered(folder, "desc", middle), 21)),
            ),
        ]
        heading = f"(pages of {args.limit})"
        print(f"{heading:<26} {'windows s':>10} {'whole folder s':>15} {'ratio':>7}")
        for name, work in rows:
            now_s = median_s(lambda work=work: work(now), args.repeats)  # type: ignore[misc]
            before_s = median_s(lambda work=work: work(before), args.repeats)  # type: ignore[misc]
            print(f"{name:<26} {now_s:10.3f} {before_s:15.3f} {before_s / now_s:6.1f}x")
        now_s, before_s = walk_s(now, args.limit, newest), walk_s(before, args.limit, newest)
        print(f"{'every page (SDK walk)':<26} {now_s:10.1f} {before_s:15.1f} {before_s / now_s:6.1f}x")


if __name__ == "__main__":
    main()
