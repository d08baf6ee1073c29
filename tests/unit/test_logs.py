from __future__ import annotations

import io

import structlog
from hypothesis import given
from hypothesis import strategies as st

from shared import logs

keys = st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True).filter(lambda k: k not in ("ts", "level"))


@given(st.dictionaries(keys, st.text(), max_size=6), st.from_regex(r"[A-Z][A-Z_]{0,20}", fullmatch=True))
def test_any_string_value_round_trips_on_one_line(fields: dict[str, str], event: str) -> None:
    line = logs.render(event, fields)
    assert len(line.splitlines()) == 1
    assert not _BREAKERS.intersection(line)
    assert logs.parse_line(line) == (event, fields)


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_no_value_breaks_a_line_for_any_common_reader(value: str) -> None:
    line = logs.render("MRC_X", {"v": value})
    assert line.splitlines() == [line]
    assert line.encode().splitlines() == [line.encode()]
    assert not _BREAKERS.intersection(line)
    assert logs.parse_line(line) == ("MRC_X", {"v": value})


_BREAKERS = {chr(c) for c in [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029]}


def test_line_breakers_and_terminal_controls_are_escaped() -> None:
    value = "a\u2028b\u2029c\x85d\x0be\x0cf\x1b[31mg\x1ch\th\x00"
    line = logs.render("MRC_X", {"v": value})
    assert line == "MRC_X|v=a\\u2028b\\u2029c\\u0085d\\u000be\\u000cf\\u001b[31mg\\u001ch\\u0009h\\u0000"
    assert logs.parse_line(line) == ("MRC_X", {"v": value})


def test_escapes_are_the_contract_ones() -> None:
    line = logs.render("MRC_X", {"v": "a|b\\c\nd\re"})
    assert line == "MRC_X|v=a\\|b\\\\c\\nd\\re"


def test_ts_and_level_come_first() -> None:
    line = logs.render("MRC_X", {"job_id": "j", "level": "info", "ts": "t"})
    assert line.split("|")[1:3] == ["ts=t", "level=info"]


def test_configured_structlog_writes_pipe_lines() -> None:
    out = io.StringIO()
    logs.configure("INFO", stream=out)
    try:
        structlog.get_logger().info("MRC_SUCCESS", job_id="j1", latency=0.5, prompt_head="a|b\nc")
    finally:
        structlog.reset_defaults()
    event, fields = logs.parse_line(out.getvalue().strip())
    assert event == "MRC_SUCCESS"
    assert fields["job_id"] == "j1"
    assert fields["latency"] == "0.5"
    assert fields["prompt_head"] == "a|b\nc"
    assert fields["level"] == "info"
    assert fields["ts"].endswith("Z")


def test_stdlib_logging_is_formatted_too() -> None:
    import logging

    out = io.StringIO()
    logs.configure("INFO", stream=out)
    try:
        logging.getLogger("celery.test").error("broken\npipe | here")
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
    event, fields = logs.parse_line(out.getvalue().strip())
    assert event == "LIB_LOG"
    assert fields["msg"] == "broken\npipe | here"
    assert fields["level"] == "error"


def test_json_format_has_the_same_events_and_keys_one_line_each() -> None:
    import io
    import json

    out = io.StringIO()
    logs.configure("INFO", stream=out, fmt="json")
    try:
        log = logs.get_logger()
        log.info("MRC_SUCCESS", job_id="j|1\nx", latency=0.25, output_len=12, cache_hit=False, note=None)
        log.warning("MRC_RETRY", job_id="j2", code="store_unavailable", prompt_head="a\u2028b")
        import logging

        logging.getLogger("celery.test").warning("library says %s", "hi")
    finally:
        logs.configure("INFO")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    first, second, third = (json.loads(line) for line in lines)
    assert first["event"] == "MRC_SUCCESS"
    assert (first["job_id"], first["latency"]) == ("j|1\nx", 0.25)
    assert (first["output_len"], first["cache_hit"]) == (12, False)
    assert first["level"] == "info"
    assert first["ts"].endswith("Z")
    assert second["prompt_head"] == "a\u2028b"
    assert "\u2028" not in lines[1]  # escaped: no character in a value breaks the line
    assert (third["event"], third["logger"], third["msg"]) == ("LIB_LOG", "celery.test", "library says hi")


def test_a_value_of_any_length_is_cut_to_its_head_and_tail_in_both_formats() -> None:
    """Review, helper-62: a client's 150,000-character image URI was one 150,158-character line."""
    long = "s3://bucket/" + "a" * 150_000 + "END"
    line = logs.render("MRC_ENQUEUED", {"image": long, "job_id": "j"})
    assert len(line) < logs.VALUE_MAX_CHARS + 100
    value = logs.parse_line(line)[1]["image"]
    assert value.startswith("s3://bucket/aaa")
    assert value.endswith("aaEND")
    assert "characters cut" in value
    as_json = logs._json_line("MRC_ENQUEUED", {"image": long})
    assert len(as_json) < logs.VALUE_MAX_CHARS + 100
    # a traceback keeps more, and its last lines (the error itself)
    trace = "Traceback (most recent call last):\n" + "  frame\n" * 5000 + "ValueError: the cause"
    kept = logs.parse_line(logs.render("LIB_LOG", {"exc": trace}))[1]["exc"]
    assert logs.VALUE_MAX_CHARS < len(kept) < logs.TRACEBACK_MAX_CHARS + 100
    assert kept.endswith("ValueError: the cause")
    # at the limit nothing is cut
    exact = "x" * logs.VALUE_MAX_CHARS
    assert logs.parse_line(logs.render("MRC_X", {"v": exact}))[1]["v"] == exact


def test_a_value_is_cut_by_its_written_length_so_no_line_passes_the_bound() -> None:
    """Review, helper-65: cut by characters before escaping, 100,000 control characters still made a
    12,324-character value (each is 6 once escaped), and emoji 24,631 in JSON."""
    for value in ("\x01" * 100_000, "\u2028" * 100_000, "|" * 100_000, "a\x01" * 50_000):
        line = logs.render("MRC_X", {"v": value})
        assert len(line) <= logs.VALUE_MAX_CHARS + 40
        kept = logs.parse_line(line)[1]["v"]
        assert kept.startswith(value[:10])
        assert kept.endswith(value[-10:])
    for value in ("\U0001f600" * 100_000, "\x01" * 100_000):
        assert len(logs._json_line("MRC_X", {"v": value})) <= logs.VALUE_MAX_CHARS + 40


def test_a_cut_never_splits_a_surrogate_pair() -> None:
    """Review, helper-66: JSON cut between the halves of a pair a value holds as two code points."""
    import json

    for lead in range(970, 990):
        value = "a" * lead + "\ud83d\ude00" * 400
        written = json.loads(logs._json_line("MRC_X", {"v": value}))["v"]
        padded = f" {written} "  # a neighbour on each side, so a half at either end is seen
        for i, ch in enumerate(padded):
            if "\ud800" <= ch <= "\udbff":
                assert "\udc00" <= padded[i + 1] <= "\udfff", (lead, i)
            if "\udc00" <= ch <= "\udfff":
                assert "\ud800" <= padded[i - 1] <= "\udbff", (lead, i)
