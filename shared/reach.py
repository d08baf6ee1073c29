"""Can this process reach Redis and S3? One quick, bounded check before a command or a worker starts,
so an outage is one line naming what is unreachable (exit 5) instead of half a minute of retries
and a traceback, and a person at a terminal is not left guessing whether their job failed."""

from __future__ import annotations

import redis

from shared import redis_target
from shared.errors import ServiceUnreachable, StoreUnavailable
from shared.settings import Settings


def check_redis(settings: Settings) -> None:
    timeout = settings.connect_timeout_s
    client = redis_target.client(settings, socket_connect_timeout=timeout, socket_timeout=timeout, retry=None)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ServiceUnreachable(f"Redis at {redis_target.where(settings)}", _first_line(exc)) from None
    finally:
        client.close()


def check_s3(settings: Settings) -> None:
    from shared.stores.s3 import S3Connection

    try:
        # An answer within MRC_CONNECT_TIMEOUT_S too (review, helper-74: an S3 that hangs took the
        # stores' read timeout, 30 s, before a command or a starting worker said so).
        S3Connection(settings, attempts=1, read_timeout=settings.connect_timeout_s).probe(settings.s3_bucket)
    except StoreUnavailable as exc:
        where = settings.s3_endpoint_url or "AWS"
        raise ServiceUnreachable(f"S3 at {where}", _first_line(exc.message)) from None


def check(settings: Settings, *, need_redis: bool = True, need_s3: bool = True) -> None:
    if need_redis:
        check_redis(settings)
    if need_s3:
        check_s3(settings)


def _first_line(error: object) -> str:
    text = str(error).strip()
    return (text.splitlines() or ["unknown error"])[0][:300]
