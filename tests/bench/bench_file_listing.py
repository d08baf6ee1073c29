"""`GET /v1/files` pages as a key keeps more files: a page of the newest, a page deep in the list, and
a walk of every page (the SDK's auto-paging), the folder read a window at a time (now) against the
whole folder listed at every page (before: the same path a cursor that is no file id still takes).

Real moto S3 server; N files made one every ~9 hours back from now (ids carry their milliseconds).

    .venv/bin/python tests/bench/bench_file_listing.py [--files 1500] [--limit 20]
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set

HOUR_MS = 3_600_000


def main() -> None:
    parser = argparse.ArgumentParser(description="GET /v1/files pages, windows against the whole folder")
    parser.add_argument("--files", type=int, default=1500)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    logs.configure("WARNING")
    with services.local_stack("mrc-bench-files-", "mrc-bench", ROOT / ".cache" / "mrc") as env:
        from producer.openai.files import Files
        from shared.stores.s3 import S3Connection

        settings = services.settings_from_env(env)
        files = Files(settings, S3Connection(settings))
        rng, now = random.Random(3), int(time.time() * 1000)
        ids = [f"file-{now - n * 9 * HOUR_MS:012x}{rng.getrandbits(64):016x}" for n in range(args.files)]
        began = time.perf_counter()
        for file_id in ids:
            files.create("k", io.BytesIO(b'{"custom_id": "a"}\n'), "f.jsonl", "batch", file_id=file_id)
        print(f"{args.files} files made in {time.perf_counter() - began:.1f} s")
        newest = sorted(ids, reverse=True)
        before = Files(settings, S3Connection(settings))
        before._ordered = whole_folder(before)  # type: ignore[method-assign]

        def page_s(of: Files, after: str | None) -> float:
            times = []
            for _ in range(args.repeats):
                began = time.perf_counter()
                of.list("k", None, args.limit, "desc", after)
                times.append(time.perf_counter() - began)
            return statistics.median(times)

        def walk_s(of: Files) -> float:
            began, after, seen = time.perf_counter(), None, []
            while True:
                page = of.list("k", None, args.limit, "desc", after)
                seen += [item["id"] for item in page["data"]]
                if not page["has_more"]:
                    assert seen == newest, "a walk that missed or repeated files"
                    return time.perf_counter() - began
                after = page["last_id"]

        print(f"{'a page of ' + str(args.limit):<26} {'windows s':>10} {'whole folder s':>15} {'ratio':>7}")
        for name, after in (("the newest", None), ("from the middle", newest[args.files // 2])):
            now_s, before_s = page_s(files, after), page_s(before, after)
            print(f"{name:<26} {now_s:10.3f} {before_s:15.3f} {before_s / now_s:6.1f}x")
        now_s, before_s = walk_s(files), walk_s(before)
        print(f"{'every page (SDK walk)':<26} {now_s:10.1f} {before_s:15.1f} {before_s / now_s:6.1f}x")


def whole_folder(files: Any) -> Any:
    """The listing before: the key's whole folder at every page, sorted here."""
    from producer.openai import file_order

    def ordered(folder: str, order: str, after: str | None) -> Iterator[str]:
        ids = sorted(file_order.ids_of(folder, files._keys(folder)), reverse=order == "desc")
        return iter([i for i in ids if after is None or (i < after if order == "desc" else i > after)])

    return ordered


if __name__ == "__main__":
    main()
