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
    assert "\n" not in line and "\r" not in line
    assert logs.parse_line(line) == (event, fields)


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
    assert fields["job_id"] == "j1" and fields["latency"] == "0.5" and fields["prompt_head"] == "a|b\nc"
    assert fields["level"] == "info" and fields["ts"].endswith("Z")


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
    assert event == "LIB_LOG" and fields["msg"] == "broken\npipe | here" and fields["level"] == "error"
