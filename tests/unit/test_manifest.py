"""Backlog manifests: each line checked on its own, job ids stable per run and custom id."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from producer.backlog import cli as backlog_cli
from producer.backlog import manifest
from producer.backlog import run as backlog
from producer.backlog.manifest import Invalid, Line
from producer.backlog.progress import Display, describe
from shared.jobs import JOB_ID_RE
from shared.settings import Settings

SETTINGS = Settings(allowed_buckets=["photos"])


def _line(**fields: object) -> bytes:
    base = {"custom_id": "c1", "image": "s3://photos/a.jpg", "prompt": "Refund?"}
    return json.dumps({**base, **fields}).encode()


def test_a_good_line_becomes_a_job_under_the_run() -> None:
    item = manifest.parse(3, _line(max_new_tokens=16, ticket_id="T-9"), "run-1", SETTINGS)
    assert isinstance(item, Line)
    assert (item.number, item.custom_id, item.job_id) == (3, "c1", "run-1.c1")
    assert (item.max_new_tokens, item.ticket_id) == (16, "T-9")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (json.dumps({"custom_id": "c", "image": "s3://photos/a.jpg"}).encode(), "missing field: prompt"),
        (_line(prompt=7), "prompt must be a string"),
        (_line(custom_id=""), "custom_id must be"),
        (_line(max_new_tokens="16"), "max_new_tokens must be an integer"),
        (_line(max_new_tokens=True), "max_new_tokens must be an integer"),
        (_line(max_new_tokens=0), "max_new_tokens"),
        (_line(prompt="x" * 9000), "prompt"),
        (_line(prompt="x" * 100_000), "the limit is 65536"),
        (_line(prompt="a\x00b"), "NUL"),
        (_line(image="http://example.com/a.jpg"), "image_source_forbidden"),
        (_line(image="s3://elsewhere/a.jpg"), "image_source_forbidden"),
        (_line(image="s3://photos/../x.jpg"), "'..'"),
        # no S3 object has a key past 1,024 bytes: refused here, not failed by the worker (review)
        (_line(image="s3://photos/" + "\u00e9" * 511 + ".jpg"), "1026 bytes"),
        (_line(colour="red"), "unknown field"),
        (_line(ticket_id=5), "ticket_id"),
    ],
)
def test_a_bad_line_is_invalid_with_its_number_and_reason(raw: bytes, reason: str) -> None:
    item = manifest.parse(7, raw, "run-1", SETTINGS)
    assert isinstance(item, Invalid)
    assert item.number == 7
    assert reason.lower() in item.reason.lower(), item.reason


def test_blank_lines_are_skipped_and_numbers_follow_the_file() -> None:
    stream = io.BytesIO(b"\n" + _line() + b"\n   \n" + _line(custom_id="c2") + b"\n")
    parsed = [manifest.parse(n, raw, "r", SETTINGS) for n, raw in manifest.read_lines(stream)]
    assert [p.number for p in parsed if p is not None] == [2, 4]


@pytest.mark.parametrize("custom_id", ["ticket 42/photo", "x" * 200, "ü-ñ", "a b"])
def test_custom_ids_outside_the_job_id_alphabet_are_hashed_stably(custom_id: str) -> None:
    first = manifest.job_id_for("run-1", custom_id)
    assert JOB_ID_RE.match(first)
    assert first == manifest.job_id_for("run-1", custom_id)
    assert first.startswith("run-1:")
    assert first != manifest.job_id_for("run-2", custom_id)


def test_the_readable_and_hashed_forms_never_meet() -> None:
    """A custom id that looks like a hash stays readable ('.'); a hashed one takes ':'."""
    hashed = manifest.job_id_for("r", "needs hashing!")
    literal = manifest.job_id_for("r", hashed.split(":", 1)[1])
    assert literal != hashed


def test_run_ids_may_not_hold_the_separators() -> None:
    assert manifest.RUN_ID_RE.match(manifest.new_run_id())
    for bad in ("a.b", "a:b", "", "-x", "x" * 65):
        assert not manifest.RUN_ID_RE.match(bad)


def test_chunks_are_cut_by_line_position_whatever_was_blank() -> None:
    lines = [(n, b"x") for n in range(1, backlog.CHUNK_LINES * 2 + 3)]
    chunks = list(manifest.chunks(lines, backlog.CHUNK_LINES))
    assert [number for number, _ in chunks] == [0, 1, 2]
    assert chunks[1][1][0][0] == backlog.CHUNK_LINES + 1
    assert sum(len(c) for _, c in chunks) == len(lines)


def test_a_listing_becomes_manifest_lines_without_folders() -> None:
    rows = [json.loads(r) for r in manifest.from_listing(["p/a.jpg", "p/", "p/b.png"], "photos", "Why?")]
    assert rows == [
        {"custom_id": "p/a.jpg", "image": "s3://photos/p/a.jpg", "prompt": "Why?"},
        {"custom_id": "p/b.png", "image": "s3://photos/p/b.png", "prompt": "Why?"},
    ]


@pytest.mark.parametrize("uptime_s", [0.0, 5.0, 1e7])
def test_progress_off_a_terminal_is_one_plain_line_per_interval(uptime_s: float) -> None:
    """Whatever the machine's uptime (a monotonic clock near 0 just after boot included)."""
    out = io.StringIO()
    display = Display(out, interval_s=3600, live=False, clock=lambda: uptime_s)
    snapshot = backlog.Progress("r").snapshot()
    display.show({**snapshot, "lines": 1})
    display.show({**snapshot, "lines": 2, "waiting_for_room": True})
    display.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # the first at once, the last on close; none in between
    assert "lines 1" in lines[0]
    assert "waiting for room" in lines[1]
    assert all(ch.isprintable() for ch in out.getvalue().replace("\n", ""))


def test_status_line_names_failures_by_code() -> None:
    status = {
        "run_id": "r", "jobs": 10, "succeeded": 7, "failed": 2, "queued": 1, "running": 0,
        "invalid_lines": 1, "rate_per_s": 2.5, "eta_s": 4000, "failed_by_code": {"image_decode_error": 2},
    }  # fmt: skip
    line = describe(status)
    assert "7/10 done" in line
    assert "image_decode_error 2" in line
    assert "ETA 1h06m" in line
    assert "unknown" not in line
    assert "3 unknown" in describe({**status, "unknown": 3})  # review: --json had it, the line not
    assert "run r:" in line
    # A run whose pass was killed is no run done (review, helper-76: "90/90 done", report exit 0).
    assert "run r (enqueuing: not every line is queued yet" in describe({**status, "state": "enqueuing"})
    assert "without a record (lost with Redis's data" in describe({**status, "unknown": 3, "lost": 3})


def test_the_report_of_a_run_whose_enqueue_has_not_ended_is_no_success(
    capsys: pytest.CaptureFixture[str],
) -> None:
    summary = {"run_id": "r", "state": "enqueuing", "counts": {"succeeded": 90}}
    assert backlog_cli._exit_for(summary) == backlog_cli.EXIT_TIMEOUT
    assert "mrc backlog --resume r" in capsys.readouterr().err
    assert backlog_cli._exit_for({**summary, "state": "enqueued"}) == backlog_cli.EXIT_OK


class _Counting(io.BytesIO):
    """A stream that remembers the largest single read asked of it."""

    largest = 0

    def readline(self, size: int | None = -1) -> bytes:
        line = super().readline(size)
        self.largest = max(self.largest, len(line))
        return line


def test_a_file_without_newlines_is_never_read_whole() -> None:
    huge = b"x" * (5 * manifest.MAX_LINE_BYTES) + b"\n" + _line() + b"\n"
    stream = _Counting(huge)
    lines = list(manifest.read_lines(stream))
    assert [n for n, _ in lines] == [1, 2]
    assert stream.largest <= manifest.MAX_LINE_BYTES + 2
    first = manifest.parse(1, lines[0][1], "run-1", SETTINGS)
    assert isinstance(first, Invalid)
    assert "the limit is 65536" in first.reason
    assert isinstance(manifest.parse(2, lines[1][1], "run-1", SETTINGS), Line)


def test_a_local_image_that_is_missing_or_too_big_is_invalid_before_anything_is_queued(tmp_path) -> None:
    missing = manifest.parse(3, _line(image=str(tmp_path / "none.jpg")), "run-1", SETTINGS)
    assert isinstance(missing, Invalid)
    assert "not found" in missing.reason
    big = tmp_path / "big.jpg"
    big.write_bytes(b"\xff" * (SETTINGS.max_image_bytes + 1))
    over = manifest.parse(4, _line(image=str(big)), "run-1", SETTINGS)
    assert isinstance(over, Invalid)
    assert "the limit is" in over.reason
    folder = manifest.parse(5, _line(image=str(tmp_path)), "run-1", SETTINGS)
    assert isinstance(folder, Invalid)


@pytest.mark.parametrize("ending", [b"", b"\n", b"\r\n"])
def test_the_line_limit_is_the_lines_own_whatever_ends_it(ending: bytes) -> None:
    """Review, helper-63: 65,535 bytes were refused with CRLF and taken with LF, and 65,536 taken as
    the last line without a newline but refused with one."""
    base = _line()
    for size, good in ((manifest.MAX_LINE_BYTES, True), (manifest.MAX_LINE_BYTES + 1, False)):
        raw = base[:-1] + b" " * (size - len(base)) + base[-1:]  # JSON's own spaces before the }
        assert len(raw) == size
        after = _line(custom_id="next") + b"\n" if ending else b""  # without an ending: the last line
        lines = list(manifest.read_lines(io.BytesIO(raw + ending + after)))
        assert [n for n, _ in lines] == ([1, 2] if ending else [1])
        item = manifest.parse(1, lines[0][1], "run-1", SETTINGS)
        assert isinstance(item, Invalid) is not good, (size, ending, item)


def test_a_custom_id_as_long_as_an_s3_key_is_taken() -> None:
    key = "complaints/" + "k" * 1000
    assert isinstance(manifest.parse(1, _line(custom_id=key), "run-1", SETTINGS), Line)
    assert isinstance(manifest.parse(1, _line(custom_id="k" * 1025), "run-1", SETTINGS), Invalid)


def test_a_huge_number_and_a_directory_are_named_as_they_are(tmp_path: Path) -> None:
    """Review, helper-63: max_new_tokens 1e30 was reported as 'got 10000000000000000000' (its first 20
    digits) and a directory as 'image file not found'."""
    huge = manifest.parse(1, _line()[:-1] + b', "max_new_tokens": 1' + b"0" * 30 + b"}", "run-1", SETTINGS)
    assert isinstance(huge, Invalid)
    assert "a number of 31 digits" in huge.reason
    folder = manifest.parse(1, _line(image=str(tmp_path)), "run-1", SETTINGS)
    assert isinstance(folder, Invalid)
    assert "is a directory" in folder.reason


def test_a_listing_rerun_numbers_new_objects_past_every_indexed_line() -> None:
    """Review, helper-67: an indexed line without a custom_id (refused as too long) was left out of
    the highest line, so a new object could take its number and never be queued."""
    from producer.backlog.cli import _listing

    class Files:
        def list_keys(self, prefix: str, bucket: str) -> list[str]:
            return ["in/a.jpg", "in/m-new.jpg", "in/z-long.jpg", "in/folder/"]

    class Runs:
        files = Files()

        def entries(self, run_id: str) -> list[dict[str, object]]:
            return [{"line": 1, "custom_id": "in/a.jpg", "job_id": "r.a"}, {"line": 2, "invalid": "too long"}]

    numbered = [(n, json.loads(raw)["custom_id"]) for n, raw in _listing(Runs(), "r", "b", "in/", "Q?")]
    assert numbered == [(1, "in/a.jpg"), (3, "in/m-new.jpg"), (4, "in/z-long.jpg")]
