"""Where Redis is: one address (MRC_REDIS_URL), or a master found through Sentinel (MRC_REDIS_SENTINELS)
that follows a failover. Every Redis user in mrc builds its client here, so every one of them — the
producer, the API, the worker's records, cache, heartbeats and events, `mrc` commands, the lane
exporter — finds the master the same way; the Celery broker does too (shared/transport.py's
SentinelChannel builds its pool with `pool_for`).

A failover is seen where a client connects to the master again (redis-py looks it up on every new
connection, and a connection to a demoted master fails with READONLY and reconnects): each process
logs `MRC_REDIS_FAILOVER` once per change of the master it is connected to, with the old and the new
address, and counts it. Only a connection made counts, not a Sentinel's answer: a Sentinel that has not
yet heard of a failover names the old master, and a connection to it fails and asks again; counted,
that answer logged a change back to a dead node and left /readyz naming it (a CI run's failover test).
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from redis.connection import SSLConnection
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool, SentinelManagedConnection

from shared import encoding, logs
from shared.settings import Settings

_lock = threading.Lock()
# The master this process last connected to, per Sentinel group (their addresses and the master's name).
_masters: dict[tuple[Any, ...], tuple[str, int]] = {}
failovers = 0  # changes of master this process has seen (mrc_redis_failovers_total)
_managers: dict[tuple[Any, ...], Sentinel] = {}


# A blocked read's timeout ends on the server's timer tick (`hz` 10 by default: every 100 ms), not at
# the millisecond asked: on a quiet Redis 7 an XREAD BLOCK of 1-50 ms returned after ~100 ms (a
# review's measurement). What it waits for still wakes it at once; only the timeout is late. A read
# that must end by a deadline blocks at most this much less than the time left.
SERVER_TICK_S = 0.1


def sentinel_addresses(settings: Settings) -> list[tuple[str, int]]:
    entries = [part.strip() for part in settings.redis_sentinels.split(",") if part.strip()]
    return [(host.strip("[]"), int(port)) for host, _, port in (e.rpartition(":") for e in entries)]


def uses_sentinel(settings: Settings) -> bool:
    return bool(sentinel_addresses(settings))


# Replies of a node in the middle of a failover: not this command's fault, and gone in a moment.
# redis-py already turns READONLY (a demoted master) into a reconnect; these join it.
TRANSIENT_REPLIES = ("NOREPLICAS", "MASTERDOWN", "LOADING")
# Replies of a Redis that is there but refuses for now, whatever the connection: a failover's, a script
# running long (BUSY), a cluster re-forming. redis-py takes the first word off some and names them by
# class instead (OutOfMemoryError: OOM under `noeviction`; ReadOnlyError: a replica).
REFUSALS_FOR_NOW = ("BUSY", "TRYAGAIN", "CLUSTERDOWN", *TRANSIENT_REPLIES)


def refused_for_now(exc: BaseException) -> bool:
    """Redis answered and refused for now (out of memory, a replica, a failover, a long script): a retry
    later may pass. Not a fault of the command, and not an unreachable Redis."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError | redis.exceptions.ReadOnlyError):
        return True
    if not isinstance(exc, redis.ResponseError):
        return False
    said = str(exc).rsplit("caused error: ", 1)[-1]  # a pipeline's error quotes its command first
    return said.upper().startswith(REFUSALS_FOR_NOW)


def refusal_words(exc: BaseException) -> str:
    """Redis's refusal in its own words, the first word redis-py took off put back (OOM); never the
    command a pipeline's error quotes (its keys and arguments: review, they reached API clients)."""
    said = str(exc).rsplit("caused error: ", 1)[-1]
    text = said.splitlines()[0][:300] if said else type(exc).__name__
    return f"OOM {text}" if isinstance(exc, redis.exceptions.OutOfMemoryError) else text


class FailoverConnection(SentinelManagedConnection):
    """A connection to the Sentinel-named master that treats a node's failover replies as a lost
    connection (disconnect: the next connect asks the Sentinels again), so every client's retry, and
    the broker's reconnect, rides them out. Without this, NOREPLICAS from a new master whose replicas
    are still syncing reached kombu as a plain ResponseError and stopped the worker."""

    def connect_to(self, address: Any) -> None:
        """Only a connection to an address a Sentinel has just named is noted: a reconnect of this
        object to the address it had (redis-py's command retry, kombu's health check) is not."""
        super().connect_to(address)
        self._note()

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        """Every connect comes through here (connect_to's, redis-py's command retry, kombu's): each one
        made is logged at debug level (MRC_LOG_LEVEL=DEBUG), noted or not, so the path that made a
        connection shows (how a failover noted under another key was found: OrderedSentinel)."""
        fresh = self._sock is None
        super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)
        if fresh and self._sock is not None:
            logs.get_logger().debug(
                "MRC_REDIS_CONNECTED", address=f"{self.host}:{self.port}", kind=type(self).__name__,
                thread=threading.current_thread().name,
            )  # fmt: skip

    def _note(self) -> None:
        pool = self.connection_pool
        if self._sock is not None and pool.is_master:
            note_master(group_of(pool.sentinel_manager, pool.service_name), (str(self.host), int(self.port)))

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if str(exc).startswith(TRANSIENT_REPLIES):
                self.disconnect()
                raise redis.ConnectionError(f"Redis in a failover: {str(exc)[:120]}") from exc
            raise


class FailoverSSLConnection(FailoverConnection, SSLConnection):
    pass


class ResolvingConnection(FailoverConnection):
    """For mrc's own clients (records, cache, heartbeats, events, the API, `mrc`), which retry a
    command on the same connection object: its reconnect asks the Sentinels too. Not for the broker's
    connections: kombu watches a connection's socket in its event loop, and a reconnect it did not
    make would leave the pop script's reply on a socket nobody reads (the message stuck as unacked
    until the visibility timeout); kombu reconnects its channel itself on a connection error."""

    _resolved = False  # set while connect_to connects to an address it has just looked up

    def connect_to(self, address: Any) -> None:
        self._resolved = True
        try:
            super().connect_to(address)
        finally:
            self._resolved = False

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        """redis-py 8.1 reconnects a dropped connection inside a command's retry through this method,
        not through connect(), so it went back to the address it had: the dead master, for the whole
        retry budget (30 s), after which the worker gave up. Here every reconnect asks the Sentinels."""
        resolving = not self._sock and not self._resolved and self.connection_pool.is_master
        if resolving:
            self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)
        if resolving:
            self._note()


class ResolvingSSLConnection(ResolvingConnection, SSLConnection):
    pass


def _addresses(pairs: Any) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((str(host), int(port)) for host, port in pairs))


class OrderedSentinel(Sentinel):
    """redis-py's Sentinel, but the Sentinel that answered moves to the front of the list safely.
    redis-py swaps it there by the index it found it at, unlocked: two threads that asked at once (all
    the connections a failover remakes do) swapped one list twice, and one Sentinel stood in it twice,
    another gone, for good. The master's key (`group_of`) was read off that list: the process then
    noted each new master under a key /readyz never reads, and logged no failover (CI, twice)."""

    def __init__(self, sentinels: list[tuple[str, int]], **kwargs: Any) -> None:
        super().__init__(sentinels, **kwargs)
        self.addresses = _addresses(sentinels)  # fixed: the key of this manager's masters
        self._order = threading.Lock()

    def discover_master(self, service_name: str) -> tuple[str, int]:
        with self._order:
            asked = list(self.sentinels)
        errors: list[str] = []
        for sentinel in asked:
            try:
                masters: Any = sentinel.sentinel_masters()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                errors.append(f"{sentinel} - {exc!r}")
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):
                self._to_front(sentinel)
                forced = getattr(self, "_force_master_ip", None)
                return (forced if forced is not None else state["ip"]), state["port"]
        said = f" : {', '.join(errors)}" if errors else ""
        raise MasterNotFoundError(f"No master found for {service_name!r}{said}")

    def _to_front(self, sentinel: Any) -> None:
        with self._order:
            at = next(i for i, s in enumerate(self.sentinels) if s is sentinel)
            self.sentinels[0], self.sentinels[at] = self.sentinels[at], self.sentinels[0]


def group_of(manager: Sentinel, service_name: str) -> tuple[Any, ...]:
    """The key of one Sentinel-watched master: its Sentinels' addresses, sorted, and its name (what
    `status` computes from the settings)."""
    fixed = getattr(manager, "addresses", None)
    if fixed is not None:
        return (fixed, service_name)
    kwargs = [s.connection_pool.connection_kwargs for s in manager.sentinels]
    return (_addresses((k.get("host"), k.get("port", 0)) for k in kwargs), service_name)


def note_master(group: tuple[Any, ...], address: tuple[str, int]) -> None:
    """A connection to `address` was made for `group`'s master: a change from the last one is a failover."""
    global failovers
    with _lock:
        old = _masters.get(group)
        _masters[group] = address
        named = f"{address[0]}:{address[1]}"
        logs.get_logger().debug("MRC_REDIS_NOTED", address=named, changed=old != address)
        if old is None or old == address:
            return
        failovers += 1
        # Under the lock: two threads' changes are logged in the order they were made.
        logs.get_logger().warning(
            "MRC_REDIS_FAILOVER",
            old=f"{old[0]}:{old[1]}",
            new=f"{address[0]}:{address[1]}",
            failovers=failovers,
        )


def sentinel_kwargs(settings: Settings) -> dict[str, Any]:
    """How to talk to the Sentinels themselves (their own password and TLS, not Redis's)."""
    kwargs: dict[str, Any] = {"socket_timeout": settings.connect_timeout_s}
    kwargs["socket_connect_timeout"] = settings.connect_timeout_s
    if settings.redis_sentinel_password:
        kwargs["password"] = settings.redis_sentinel_password
    if settings.redis_sentinel_username:
        kwargs["username"] = settings.redis_sentinel_username
    if settings.redis_sentinel_tls:
        kwargs["ssl"] = True
    return kwargs


def manager(settings: Settings) -> Sentinel:
    return manager_for(sentinel_addresses(settings), sentinel_kwargs(settings))


def manager_for(addresses: list[tuple[str, int]], kwargs: dict[str, Any]) -> Sentinel:
    """One Sentinel client per process and configuration (its connections to the Sentinels shared)."""
    key = (tuple(addresses), tuple(sorted(kwargs.items())))
    with _lock:
        if key not in _managers:
            _managers[key] = OrderedSentinel(list(addresses), sentinel_kwargs=dict(kwargs))
        return _managers[key]


def pool_for(
    addresses: list[tuple[str, int]], master: str, kwargs: dict[str, Any], **connection: Any
) -> SentinelConnectionPool:
    """A pool whose every new connection goes to the master the Sentinels name now."""
    ssl = connection.pop("ssl", False)
    connection.setdefault("connection_class", ResolvingSSLConnection if ssl else ResolvingConnection)
    return SentinelConnectionPool(master, manager_for(addresses, kwargs), **connection)


def url_params(url: str) -> dict[str, Any]:
    """What MRC_REDIS_URL still says when the master comes from Sentinel: db, user, password, TLS."""
    parts = urlsplit(url)
    params: dict[str, Any] = {"db": int(parts.path.strip("/") or 0)}
    if parts.username:
        params["username"] = unquote(parts.username)
    if parts.password:
        params["password"] = unquote(parts.password)
    if parts.scheme == "rediss":
        params["ssl"] = True
    return params


def sentinel_pool(settings: Settings, **connection: Any) -> SentinelConnectionPool:
    params = {**url_params(settings.redis_url), **connection}
    return pool_for(
        sentinel_addresses(settings), settings.redis_sentinel_master, sentinel_kwargs(settings), **params
    )


_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")


def broker_tls(settings: Settings) -> dict[str, Any] | None:
    """The broker's TLS options for a rediss:// MRC_REDIS_URL, as redis-py reads the same URL for
    every other client: certificates verified unless `?ssl_cert_reqs=none`, the CA and client files
    from `?ssl_ca_certs=` / `ssl_certfile` / `ssl_keyfile`. None for redis://. Celery's broker ignores
    the scheme once its transport is named (shared/celery_app.py), so without this it connected in
    clear text: to a TLS-only Redis not at all, to one that takes both with AUTH and jobs unencrypted."""
    parts = urlsplit(settings.redis_url)
    if parts.scheme != "rediss":
        return None
    query = dict(parse_qsl(parts.query))
    options: dict[str, Any] = {"ssl_cert_reqs": _CERT_REQS.get(query.get("ssl_cert_reqs", "required").lower(),
                                                               ssl.CERT_REQUIRED)}  # fmt: skip
    options.update({key: query[key] for key in _TLS_FILES if key in query})
    return options


def transport_options(settings: Settings) -> dict[str, Any]:
    """The broker's share of these settings (shared/transport.py reads them as transport options)."""
    options: dict[str, Any] = {
        "wait_replicas": settings.redis_wait_replicas,
        "wait_timeout_ms": settings.redis_wait_timeout_ms,
    }
    if uses_sentinel(settings):
        options.update(
            sentinels=sentinel_addresses(settings),
            master_name=settings.redis_sentinel_master,
            sentinel_kwargs=sentinel_kwargs(settings),
        )
    return options


def client(settings: Settings, *, max_connections: int | None = None, **options: Any) -> redis.Redis:
    """A client for the master: MRC_REDIS_URL's, or the one Sentinel names (following failovers).
    `options` are redis-py's connection options (timeouts, retry, decode_responses)."""
    if max_connections is not None:
        options["max_connections"] = max_connections
    # A value no job should carry (a lone surrogate from another producer) is written as U+FFFD rather
    # than failing the write that records the job's outcome (shared/encoding.py).
    options.setdefault("encoding_errors", encoding.REPLACE)
    if not uses_sentinel(settings):
        return redis.Redis.from_url(settings.redis_url, **options)
    # Each connection carries the retry (as from_url gives it): a connect that finds the old master
    # dead retries, and each retry asks the Sentinels again, so a failover is ridden out.
    return redis.Redis(connection_pool=sentinel_pool(settings, **options))


def where(settings: Settings) -> str:
    """What an error message names: the address, or the Sentinels and the master's name."""
    if uses_sentinel(settings):
        return f"Sentinel master {settings.redis_sentinel_master!r} via {settings.redis_sentinels}"
    parts = urlsplit(settings.redis_url)
    return f"{parts.hostname}:{parts.port or 6379}"


def status(settings: Settings) -> dict[str, Any]:
    """What /readyz and `mrc queues` say about Redis: the master in use (the one this process last
    connected to through Sentinel, or MRC_REDIS_URL's), whether it came from Sentinel, the failovers seen."""
    if not uses_sentinel(settings):
        return {"redis_master": where(settings), "redis_sentinel": False}
    group = (_addresses(sentinel_addresses(settings)), settings.redis_sentinel_master)
    with _lock:
        found = _masters.get(group)
    master = f"{found[0]}:{found[1]}" if found is not None else None
    return {
        "redis_master": master,
        "redis_sentinel": True,
        "redis_sentinel_master": settings.redis_sentinel_master,
        "redis_failovers": failovers,
    }


class FailoverCollector(Collector):
    """`mrc_redis_failovers_total`: changes of master this process has seen (its counter lives here,
    so every process that talks to Redis can serve it: the worker, the API, the lane exporter)."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "mrc_redis_failovers", "Changes of Redis master this process has followed (Sentinel)"
        )
        family.add_metric([], float(failovers))
        yield family
