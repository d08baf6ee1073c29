"""Text every store, queue and log line can hold, and JSON no input can break.

Python strings may hold lone surrogates (U+D800-U+DFFF): `json.loads` makes one of `"\\ud83d"` (what
a JavaScript client sends after cutting an emoji in half) and the command line makes them of bytes
that are not UTF-8. UTF-8 cannot encode them, so a result, a Redis record or a cache entry holding
one fails to write. The producer refuses such text at submission (`unwritable`, every field of a
job and of a manifest line); whatever still arrives (a message from another producer) can never stop
a writer: `to_bytes` writes U+FFFD in its place.

JSON nested deeper than Python's recursion limit makes `json.loads` (and every recursive walk after
it) raise RecursionError: `loads` turns that into the ValueError a malformed document raises.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from collections.abc import Callable
from typing import Any

# Deepest nesting of a JSON value any mrc input may have (a response_format schema, a manifest line,
# an API body): far beyond any real schema, far below where a recursive walk runs out of stack.
MAX_DEPTH = 64
# Most commas and opening brackets outside strings one JSON input may hold, counted before it is
# parsed: a bound on its values (a value after the first in a container follows a comma; an object or
# array is counted once more by its bracket). A 45 MB chat body of 15 million `{}` took mrc-api to
# 3.4 GB (230 bytes a value) before its 256-message limit could refuse it (review, helper-97). The
# largest real input holds ~57,000: 256 messages of 64 text parts (three each), and a 16 KiB schema.
MAX_VALUES = 100_000


def _replace(error: UnicodeError) -> tuple[str | bytes, int]:
    """U+FFFD for what cannot be encoded (a lone surrogate) or decoded (bytes that are not UTF-8).
    An encoder takes a non-ASCII replacement only as bytes (CPython's UTF-8 codec refuses the str)."""
    if isinstance(error, UnicodeEncodeError):
        return "\ufffd".encode() * (error.end - error.start), error.end
    if isinstance(error, UnicodeDecodeError):
        return "\ufffd", error.end
    raise error


REPLACE = "mrc.replace"  # the error handler's name, for str.encode and redis-py's `encoding_errors`
codecs.register_error(REPLACE, _replace)


def encode(text: str) -> bytes:
    """UTF-8, a lone surrogate written as U+FFFD: never raises."""
    return text.encode("utf-8", REPLACE)


def clean(text: str) -> str:
    """The same text with every lone surrogate replaced by U+FFFD (valid pairs are never split)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return encode(text).decode("utf-8")
    return text


def to_bytes(value: Any, **dumps: Any) -> bytes:
    """JSON as UTF-8 bytes for a store: never fails on what a job carried."""
    return encode(json.dumps(value, ensure_ascii=False, **dumps))


# What JSON leaves raw and a line reader splits on (Python's str.splitlines, JavaScript's line
# terminators): escaped, so a JSONL line is one line to every reader.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def to_text(value: Any, **dumps: Any) -> str:
    """JSON text that encodes as UTF-8 and is one line to any reader (Redis values, JSONL lines)."""
    return clean(json.dumps(value, ensure_ascii=False, **dumps)).translate(_LINE_BREAKS)


# What a terminal acts on and JSON leaves raw: C1 controls (NEL; U+009B, which some terminals read as
# the start of a control sequence), the line and paragraph separators, and the bidirectional controls
# that reorder what an operator reads (U+202E shows a text backwards).
_DISPLAY_CODES = [
    *range(0x80, 0xA0),
    0x200E,
    0x200F,
    *range(0x202A, 0x202F),
    *range(0x2066, 0x206A),
    0x2028,
    0x2029,
]
_DISPLAY = str.maketrans({chr(c): f"\\u{c:04x}" for c in _DISPLAY_CODES})


def to_display(value: Any, **dumps: Any) -> str:
    """JSON text for a person's terminal (the `mrc` commands' output): UTF-8 kept readable, but what
    a job's text could use to break a line, drive the terminal or reorder the text is escaped."""
    return clean(json.dumps(value, ensure_ascii=False, **dumps)).translate(_DISPLAY)


class TooDeep(ValueError):
    """JSON nested past MAX_DEPTH (or past what the parser can hold)."""


class PastDepth(TooDeep):
    """JSON the parser read whole, nested past MAX_DEPTH (a job's field: invalid_job, not unreadable)."""


class DuplicateKey(ValueError):
    """A JSON object naming one key twice: which value was meant cannot be told (json keeps the last)."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook refusing a key given twice (review, helper-84: `{"prompt": "first",
    "prompt": "second"}` ran "second", where multipart refuses a field given twice)."""
    value = dict(pairs)
    if len(value) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(f"{key[:64]!r} is given more than once in one object")
            seen.add(key)
    return value


class TooMany(ValueError):
    """JSON holding more than MAX_VALUES values: refused before it is parsed."""


# A string, once its escaped backslashes and quotes are taken out (at C speed, by str.replace): from a
# quote to the next, or to the end of the text for one never closed. A match always succeeds from any
# quote, so the search never starts again inside a failed one (review, helper-100: `"\\"\\"...` left
# open began it again at every escaped quote, 24.6 s for 80 KB), and takes no step per escape
# (helper-101: 2-4 s over 45 MB of them). The strings are counted first: past 2 x the limit of them,
# no real request (~65,000 at most), and no sub of that many matches is run.
_STRING = re.compile(r'"[^"]*(?:"|\Z)')


def values_problem(text: str | bytes | bytearray, limit: int = MAX_VALUES) -> str | None:
    """Why this JSON text holds too many values to parse, or None; counted without parsing it (see
    MAX_VALUES). Counted over the whole text first (C speed: a 45 MB body in ~20 ms, and a base64
    image holds none of them); only where that passes the limit are the strings, which may hold them,
    taken out and the rest counted again, in one pass. Bytes are read as `json.loads` reads them:
    UTF-16 or UTF-32 decoded first (their quotes are not the byte 0x22: review, helper-100, a UTF-16
    batch line passed the count and was parsed whole)."""
    if isinstance(text, bytes | bytearray):
        kind = json.detect_encoding(text)
        if kind not in ("utf-8", "utf-8-sig"):
            try:
                text = bytes(text).decode(kind, "surrogatepass")
            except (UnicodeDecodeError, LookupError):
                return None  # json.loads cannot read it either
    if _marks(text) <= limit:
        return None
    plain = text if isinstance(text, str) else bytes(text).decode("latin-1")  # UTF-8: quotes are 0x22
    plain = plain.replace("\\\\", "").replace('\\"', "")
    if plain.count('"') > 4 * limit:
        return f"JSON holding too many values: more than {2 * limit} strings"
    if _marks(_STRING.sub("", plain)) <= limit:
        return None
    return f"JSON holding too many values: more than {limit} commas and opening brackets outside strings"


def _marks(text: str | bytes | bytearray) -> int:
    if isinstance(text, str):
        return text.count(",") + text.count("[") + text.count("{")
    return text.count(b",") + text.count(b"[") + text.count(b"{")


def loads(text: str | bytes | bytearray) -> Any:
    """json.loads, with nesting past MAX_DEPTH (or past what the parser can hold) a ValueError, more
    than MAX_VALUES values a TooMany (before parsing), and a key given twice in one object a
    DuplicateKey (ValueErrors too)."""
    problem = values_problem(text)
    if problem:
        raise TooMany(problem)
    try:
        value = json.loads(text, object_pairs_hook=unique_keys)
    except RecursionError:
        raise TooDeep("JSON nested too deeply") from None
    problem = depth_problem(value)
    if problem:
        raise PastDepth(problem)
    return value


def depth_problem(value: Any, limit: int = MAX_DEPTH) -> str | None:
    """Why this JSON value is nested too deeply, or None. Iterative: a hostile value cannot exhaust
    the stack here."""
    if not isinstance(value, dict | list):
        return None
    stack: list[tuple[Any, int]] = [(value, 1)]  # containers only: a scalar is never pushed
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return f"JSON nested more than {limit} levels deep"
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return None


def unwritable(value: Any, where: str = "") -> str | None:
    """The place of the first string (or object key) that is not valid Unicode, or number that JSON
    cannot hold (`1e999` parses as infinity), with why; None when every store can write the value.
    Iterative, like `depth_problem`."""
    return None if _writes(value) else _walk_unwritable(value, where)


def _walk_unwritable(value: Any, where: str) -> str | None:
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _encodes(item):
                return f"{path or 'value'}: not valid Unicode (a lone surrogate, e.g. half of an emoji)"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"{path or 'value'}: a number JSON cannot hold ({item})"
        elif isinstance(item, dict):
            for key, child in item.items():
                name = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not _encodes(key):
                    return f"{clean(name)}: a key that is not valid Unicode (a lone surrogate)"
                stack.append((child, clean(name)))
        elif isinstance(item, list | tuple):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def _writes(value: Any) -> bool:
    """Whether JSON and UTF-8 take the value as it is: at C speed, for the value that is fine (every
    one but a hostile few; a bulk enqueue checks each line's, and a walk costs 20 µs). Where they do
    not, the walk says where (or finds nothing it checks: a value only json.dumps refuses)."""
    try:
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (ValueError, TypeError, UnicodeEncodeError, RecursionError):
        return False
    return True


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# json's C string scanner: a string's value and where it ends (escapes, surrogates as json.loads
# reads them); typeshed does not declare it.
_scan_string: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_SPACE = re.compile(r"[ \t\n\r]*")
_BRACKET_OR_QUOTE = re.compile(r'["\[\]{}]')
# A top-level scalar as json.loads reads one (NaN and the infinities included): a bare word is no
# value, and a line with one is not JSON, so it names no custom_id (review, helper-114).
_SCALAR = re.compile(r"true|false|null|NaN|-?Infinity|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


def top_level_string(raw: str | bytes, name: str) -> str | None:
    """The string a JSON object gives its top-level key `name`, read without building anything else
    it holds: for an object nested past what `json.loads` can parse (RecursionError), whose other
    values no one can read. None where the text is not an object, gives `name` no string, or gives
    it twice differently (json keeps the last: an answer under either might not be the client's).
    What is nested below the top level is skipped by its brackets and strings, not checked as JSON:
    no parser here can read it. Iterative, linear in the text, and bounded in the strings it reads as
    any JSON value is in its values (MAX_VALUES)."""
    try:
        text = raw if isinstance(raw, str) else raw.decode(json.detect_encoding(raw), "surrogatepass")
        found = _top_level_values(text, name)
    except (ValueError, IndexError):  # not an object's text (UnicodeDecodeError is a ValueError)
        return None
    return found[0] if found and all(value == found[0] for value in found) else None


def _top_level_values(text: str, name: str) -> list[str | None]:
    found: list[str | None] = []
    at = _expect(text, _space(text, 0), "{")
    at = _space(text, at)
    while text[at] != "}":
        key, value, at = _member(text, at)
        if key == name:
            found.append(value)  # None: not a string, no id to give
        at = _space(text, at)
        if text[at] == ",":
            at = _space(text, at + 1)
            if text[at] != '"':  # a comma before the end, or before no key: not JSON
                raise ValueError("no key after a comma")
        elif text[at] != "}":
            raise ValueError("no comma")
    if _space(text, at + 1) != len(text):
        raise ValueError("more after the object")
    return found


def _member(text: str, at: int) -> tuple[str, str | None, int]:
    """An object's `"key": value` at `at`: its key, its value where it is a string, and its end."""
    key, at = _scan_string(text, _expect(text, at, '"'))
    at = _space(text, _expect(text, _space(text, at), ":"))
    if text[at] == '"':
        value, at = _scan_string(text, at + 1)
        return key, value, at
    return key, None, _skip_value(text, at)


def _expect(text: str, at: int, char: str) -> int:
    if text[at] != char:
        raise ValueError(f"no {char!r}")
    return at + 1


def _space(text: str, at: int) -> int:
    match = _SPACE.match(text, at)
    assert match is not None  # `*` matches the empty string
    return match.end()


def _skip_value(text: str, at: int) -> int:
    """Where the array, object or scalar that starts at `at` ends."""
    if text[at] not in "[{":
        scalar = _SCALAR.match(text, at)
        if scalar is None:
            raise ValueError("no value")
        return scalar.end()  # what follows is the caller's to check: a comma or the object's end
    depth, strings = 0, 0
    while True:
        mark = _BRACKET_OR_QUOTE.search(text, at)
        if mark is None:
            raise ValueError("left open")
        at = mark.end()
        if mark.group() == '"':
            strings += 1  # a key or a value each: JSON's need a comma or bracket each, counted
            if strings > 2 * MAX_VALUES:  # strings side by side: no JSON (review, helper-113: 1 s)
                raise ValueError("more strings than values")
            _, at = _scan_string(text, at)
        elif mark.group() in "[{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return at
