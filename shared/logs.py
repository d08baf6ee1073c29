"""Structured logs as one pipe-delimited line per event on stderr: EVENT|key=value|key=value...

Escaping keeps every line splittable on unescaped `|` and a value on one line:
`\\` -> `\\\\`, `|` -> `\\|`, newline -> `\\n`, carriage return -> `\\r`, and every other character
that some reader treats as a line break or a terminal control (C0 and C1 controls, DEL, U+2028,
U+2029), or that no stream can encode (a lone surrogate) -> `\\uXXXX`: Python's `str.splitlines()`
alone breaks on \\v, \\f, \\x1c-\\x1e, U+0085, U+2028 and U+2029, and ESC lets a value repaint an
operator's terminal.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable, Mapping, MutableMapping
from datetime import UTC, datetime
from typing import Any, TextIO

import structlog

from shared.jobs import rfc3339

_ESCAPES = {"\\": "\\\\", "|": "\\|", "\n": "\\n", "\r": "\\r"}
_UNESCAPES = {"\\": "\\", "|": "|", "n": "\n", "r": "\r"}
# Everything else that must never reach a line raw: the other C0 controls (tab too), DEL, C1 controls (U+0085
# is NEL), and the Unicode line and paragraph separators.
# Lone surrogates (U+D800-U+DFFF, from JSON like "\ud83d") too: no stream could encode them.
_CONTROL_RE = re.compile("[\x00-\x09\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_NEEDS_ESCAPE_RE = re.compile("[\\\\|\n\r\x00-\x09\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_FIRST_KEYS = ("ts", "level")
VALUE_MAX_CHARS = 2048
TRACEBACK_MAX_CHARS = 8192
_TRACEBACK_KEYS = frozenset({"exc", "exception"})


def escape(value: str) -> str:
    if not _NEEDS_ESCAPE_RE.search(value):
        return value
    return "".join(_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if _CONTROL_RE.match(ch) else ch) for ch in value)


def _split_unescaped(line: str) -> list[str]:
    """Split on unescaped `|` and undo the escapes inside each field."""
    fields: list[str] = []
    current: list[str] = []
    chars = iter(line)
    for ch in chars:
        if ch == "\\":
            nxt = next(chars, "")
            if nxt == "u":
                code = "".join(next(chars, "") for _ in range(4))
                valid = len(code) == 4 and all(c in "0123456789abcdefABCDEF" for c in code)
                current.append(chr(int(code, 16)) if valid else "\\u" + code)
                continue
            current.append(_UNESCAPES.get(nxt, "\\" + nxt))
        elif ch == "|":
            fields.append("".join(current))
            current = []
        else:
            current.append(ch)
    fields.append("".join(current))
    return fields


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def clip(key: str, text: str, written: Callable[[str], str] | None = None) -> str:
    """A value cut to VALUE_MAX_CHARS as written in the line (a traceback to TRACEBACK_MAX_CHARS), its
    head and tail kept: a client must not write a line of any length (a 150,000-character image URI
    was one), and log shippers cut long lines into parts (Docker's json-file driver at 16 KiB).
    `written`: how the line writes a text (escape, or JSON's): a control character is 6 there."""
    limit = TRACEBACK_MAX_CHARS if key in _TRACEBACK_KEYS else VALUE_MAX_CHARS
    write = written or escape
    if len(text) * 12 <= limit or len(write(text)) <= limit:  # 12: the most one character becomes
        return text
    half = limit // 2 - 40  # room for the note
    head = _fits(text, half, write)
    tail = len(text) - _fits(text[::-1], half, write)
    # a surrogate pair (from JSON like "\ud83d\ude00") stays whole: half of one is no JSON a strict
    # reader takes (review, helper-66)
    if head and "\ud800" <= text[head - 1] <= "\udbff":
        head -= 1
    if tail < len(text) and "\udc00" <= text[tail] <= "\udfff":
        tail += 1
    return f"{text[:head]}...[{tail - head} characters cut]...{text[tail:]}"


def _fits(text: str, room: int, write: Callable[[str], str]) -> int:
    """How many leading characters of `text` fit in `room` characters once written."""
    used = 0
    for count, ch in enumerate(text):
        used += len(write(ch))
        if used > room:
            return count
    return len(text)


def _json_text(text: str) -> str:
    return json.dumps(text, ensure_ascii=True)[1:-1]


def _json_line(event: str, fields: Mapping[str, object]) -> str:
    """Numbers, booleans and null stay typed; anything else is its text, as in the pipe format."""
    data: dict[str, object] = {"event": event}
    for key, value in fields.items():
        plain = value is None or isinstance(value, bool | int | float)
        data[key] = value if plain else clip(key, _text(value), _json_text)
    return json.dumps(data, ensure_ascii=True, allow_nan=False, default=str)


def render(event: str, fields: Mapping[str, object]) -> str:
    """One log line. Keys are assumed to be plain identifiers; values are escaped."""
    ordered = [k for k in _FIRST_KEYS if k in fields] + [k for k in fields if k not in _FIRST_KEYS]
    parts = [escape(event.upper())]
    parts.extend(f"{key}={escape(clip(key, _text(fields[key])))}" for key in ordered)
    return "|".join(parts)


def parse_line(line: str) -> tuple[str, dict[str, str]]:
    """Read one rendered line back into (EVENT, {key: value}); values are strings."""
    fields = _split_unescaped(line.rstrip("\n"))
    event, pairs = fields[0], fields[1:]
    data: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"field without '=' in log line: {pair[:60]!r}")
        data[key] = value
    return event, data


class PipeRenderer:
    """structlog processor: the final step, turning the event dict into one line."""

    def __call__(self, _logger: object, _method: str, event_dict: MutableMapping[str, Any]) -> str:
        event = str(event_dict.pop("event", "MRC_LOG"))
        return render(event, event_dict)


def _utc_ts() -> str:
    return rfc3339(timespec="microseconds")


def _add_ts(_logger: object, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    event_dict.setdefault("ts", _utc_ts())
    return event_dict


class JsonRenderer:
    """structlog processor for `MRC_LOG_FORMAT=json`: the same event and keys, one JSON object a line
    (`event` first). ASCII-only, so no character in a value can break the line."""

    def __call__(self, _logger: object, _method: str, event_dict: MutableMapping[str, Any]) -> str:
        event = str(event_dict.pop("event", "MRC_LOG"))
        return _json_line(event, event_dict)


class PipeFormatter(logging.Formatter):
    """Puts third-party stdlib logging (Celery, kombu, botocore) into the same line format."""

    json = False

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, object] = {
            "ts": rfc3339(datetime.fromtimestamp(record.created, UTC), "microseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        if self.json:
            return _json_line("LIB_LOG", fields)
        return render("LIB_LOG", fields)


def configure(level: str = "INFO", stream: TextIO | None = None, fmt: str = "pipe") -> None:
    """Set up structlog and stdlib logging to write one line per event to stderr: pipe-delimited
    (the default), or JSON (`fmt="json"`, for ELK or Loki)."""
    out = stream or sys.stderr
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            _add_ts,
            structlog.processors.format_exc_info,
            JsonRenderer() if fmt == "json" else PipeRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    formatter = PipeFormatter()
    formatter.json = fmt == "json"
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    logging.captureWarnings(True)
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "kombu", "celery"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))
    # Library chatter at INFO (botocore credentials, celery banners) drowns the job events.
    root.setLevel(max(numeric, logging.WARNING))


def get_logger(**bound: object) -> Any:
    return structlog.get_logger().bind(**bound)
