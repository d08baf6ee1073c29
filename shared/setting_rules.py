"""The checks of single settings that need more than a type and a range (shared/settings.py applies
them): values are refused at start, in one line naming the variable, rather than taken and then
failing at runtime or in a traceback (reviews: 10**23 for MRC_EVENTS_MAX made every Redis write fail,
for MRC_API_WORKERS mrc-api started processes until the kernel killed them; a region botocore
refuses, a Redis URL option redis-py refuses)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, urlsplit

from pydantic import ValidationError

# What any number setting may be at most, where it has no upper bound of its own (MRC_OPENAI_FILE_MAX_
# BYTES keeps its 5 GiB): counts within a signed 32-bit integer, byte counts up to a TiB, seconds and
# milliseconds within about 31 years (below every timer's limit).
INT_CEILING = 2**31 - 1
BYTES_CEILING = 2**40
FLOAT_CEILING = 1e9
# What botocore takes for a region (a host label, not all digits: MinIO's, R2's `auto`, Garage's
# `garage` pass) and S3-compatible stores for a bucket name (at least 3 characters).
_REGION = re.compile(r"(?![0-9]+$)(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{2,254}")
_REDIS_SCHEMES = ("redis", "rediss")


def bounded_number(value: object, name: str, metadata: Iterable[object]) -> object:
    """A number finite and, without an upper bound of its own, under the ceiling for its kind."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number")
    if any(
        getattr(item, "le", None) is not None or getattr(item, "lt", None) is not None for item in metadata
    ):
        return value  # its Field's le / lt decided already
    ceiling = FLOAT_CEILING if isinstance(value, float) else INT_CEILING
    if name.endswith("_bytes") and isinstance(value, int):
        ceiling = BYTES_CEILING
    if value > ceiling:
        raise ValueError(f"must be at most {ceiling:.0f}")
    return value


def region(value: str) -> str:
    if not _REGION.fullmatch(value):
        raise ValueError("MRC_S3_REGION must be a region name, e.g. us-east-1 or eu-west-1")
    return value


def bucket(value: str) -> str:
    if not _BUCKET.fullmatch(value):
        raise ValueError(f"{value[:64]!r} is not a bucket name: 3-255 letters, digits, '.', '-' or '_'")
    return value


URL_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")


def redis_url(value: str) -> str:
    """MRC_REDIS_URL as every Redis client of mrc will read it (its scheme lower-cased: redis-py reads
    it case-sensitively)."""
    head, sep, rest = value.partition("://")
    value = head.lower() + sep + rest
    url = urlsplit(value)
    if url.scheme not in _REDIS_SCHEMES:
        # unix:// sockets: the broker (kombu) takes them only as its own redis+socket:// form, and
        # Sentinel never; refused here rather than at the first publish.
        raise ValueError(
            "MRC_REDIS_URL must start with redis:// or rediss:// (unix sockets are not supported)"
        )
    try:
        port = url.port  # raises for a port that is not a number in 0-65535
    except ValueError:
        raise ValueError("MRC_REDIS_URL has a port that is not a number from 1 to 65535") from None
    if not url.hostname or port == 0:
        raise ValueError("MRC_REDIS_URL needs a host, e.g. redis://127.0.0.1:6379/0")
    database = url.path.strip("/")
    if database and not (database.isascii() and database.isdigit()):
        raise ValueError("MRC_REDIS_URL's database must be a number, e.g. /0")
    _url_options(url.query)
    _as_redis_py_reads(value)
    return value


def _url_options(query: str) -> None:
    """Its TLS options alone: the broker (kombu) fails at its first publish on others redis-py takes
    (?socket_timeout=2: review, helper-75), and mrc sets its own timeouts (MRC_CONNECT_TIMEOUT_S)."""
    others = sorted({name for name, _ in parse_qsl(query, keep_blank_values=True)} - set(URL_OPTIONS))
    if others:
        raise ValueError(
            f"MRC_REDIS_URL: option {others[0][:40]!r} is not taken; the URL takes {', '.join(URL_OPTIONS)} "
            "(mrc sets its own timeouts: MRC_CONNECT_TIMEOUT_S)"
        )
    requirement = dict(parse_qsl(query)).get("ssl_cert_reqs", "required").lower()
    if requirement not in ("none", "optional", "required"):
        raise ValueError("MRC_REDIS_URL's ssl_cert_reqs must be none, optional or required")


def _as_redis_py_reads(value: str) -> None:
    try:
        import redis
    except ImportError:  # a process that uses no Redis, without it installed (the GPU proving ground)
        return
    try:  # a connection made as every client makes one, not connected: its options read and checked
        redis.ConnectionPool.from_url(value).make_connection()
    except ValueError as exc:  # e.g. ?socket_timeout=abc (review: a traceback from every command)
        raise ValueError(f"MRC_REDIS_URL: {str(exc)[:200]}") from None
    except TypeError as exc:  # ?bogus=1 (review, helper-73: a traceback from every command)
        unknown = str(exc).rpartition("argument ")[2] or str(exc)[:100]
        raise ValueError(f"MRC_REDIS_URL: unknown option {unknown}") from None
    except redis.RedisError as exc:  # ?protocol=9: read as Redis being away (exit 5), not a bad setting
        raise ValueError(f"MRC_REDIS_URL: {str(exc)[:200]}") from None


def sentinels(value: str) -> str:
    for entry in filter(None, (part.strip() for part in value.split(","))):
        host, _, port = entry.rpartition(":")
        if not host or not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
            raise ValueError(f"MRC_REDIS_SENTINELS: {entry!r} is not host:port (e.g. 10.0.0.5:26379)")
    return value


def s3_endpoint(value: str) -> str:
    url = urlsplit(value)
    if value and (url.scheme not in ("http", "https") or not url.hostname):
        raise ValueError("MRC_S3_ENDPOINT_URL must be empty (AWS) or an http(s)://host[:port] URL")
    try:
        port = url.port  # raises for a port that is not a number in 0-65535
    except ValueError:
        port = 0
    if value and port == 0:
        raise ValueError("MRC_S3_ENDPOINT_URL has a port that is not a number from 1 to 65535")
    return value


def device(value: str) -> str:
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:[0-9]{1,4}", value):
        return value
    raise ValueError("MRC_DEVICE must be auto, cpu, cuda or cuda:N")


def describe_error(exc: ValidationError, prefix: str) -> str:
    """One line per bad setting, named as the operator set it: `MRC_X=value: why`."""
    lines = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error.get("loc", ()))
        name = prefix + field.upper() if field else "settings"
        value = error.get("input")
        shown = f"={_redact(str(value))[:80]!r}" if field and isinstance(value, str | int | float) else ""
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        lines.append(f"{name}{shown}: {message}")
    return "; ".join(lines)


def _redact(value: str) -> str:
    """A URL with its password hidden: settings errors go to logs, secrets must not."""
    return re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", value)
