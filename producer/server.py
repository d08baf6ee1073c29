"""`mrc-api`: the HTTP intake for upstream systems (FastAPI; producer side, no torch), assembled here
from its rooms: mrc's own routes (producer/http/jobs.py: /v1/jobs, /v1/events, probes, metrics) and
the OpenAI-compatible ones (producer/openai/routes.py), behind one front door (producer/http/front.py:
keys, rate limits, body limits per route, faults as JSON, counting) and the layer that gives the
OpenAI routes OpenAI's error shape (producer/openai/errors.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from producer.http.forms import error, invalid_job
from producer.http.front import Front, Limits
from producer.http.guard import Keys, RateLimiter
from producer.http.jobs import JobRoutes
from producer.http.ops_routes import OpsRoutes
from producer.http.state import MULTIPROCESS_DIR, ApiState
from producer.openai.errors import OpenAIErrors
from producer.openai.routes import OpenAIRoutes
from producer.queue.sender import Queue
from shared import logs, reach
from shared.errors import MrcError, ServiceUnreachable, StoreUnavailable
from shared.records import scrape_client
from shared.settings import Settings
from shared.usage import UsageCollector

SMALL_BODY_BYTES = 64 * 1024  # a batch create, a cancel, any other POST: a few KiB of JSON at most
# The framework's own refusals (no such route, a method the route has not, a multipart body the parser
# refuses: no boundary, too many fields, a field over 1 MiB) in the contract's error shape.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "invalid_job", 415: "invalid_job"}


def job_json_bytes(settings: Settings) -> int:
    """The largest JSON job body: its prompt and response_format at their limits, every character
    written as a 6-byte \\u escape, and 64 KiB for the rest (ids, an s3:// URI, a deadline)."""
    return 6 * (settings.max_prompt_chars + settings.max_response_format_bytes) + SMALL_BODY_BYTES


def limits(settings: Settings) -> Limits:
    """Each route's body limit, by what it carries. MRC_API_MAX_BODY_BYTES, when set, caps them all
    (the file upload has its own, MRC_OPENAI_FILE_MAX_BYTES)."""

    def capped(limit: int) -> int:
        return min(limit, settings.api_max_body_bytes) if settings.api_max_body_bytes else limit

    # A chat request carries its image as base64 (4 characters per 3 bytes); a file is a batch's input.
    chat = (settings.max_image_bytes + 2) // 3 * 4 + (1 << 20)
    paths = (
        ("/v1/chat/", "", capped(chat)),
        ("/v1/files", "", settings.openai_file_max_bytes + (1 << 20)),
        ("/v1/jobs", "multipart/form-data", capped(settings.max_image_bytes + (1 << 20))),
        ("/v1/jobs", "", capped(job_json_bytes(settings))),
    )
    return Limits(
        capped(SMALL_BODY_BYTES), settings.api_max_bodies, settings.api_drain_bytes,
        body_read_s=settings.api_body_timeout_s, paths=paths, heavy_paths=("/v1/chat/",),
    )  # fmt: skip


async def _invalid(_request: Request, exc: Exception) -> JSONResponse:
    """A body's fault is the job's (422 `invalid_job`); a query's is the request's, 400
    `invalid_request` as `?after=` answers on the same route (`?wait=-1` was 422 `invalid_job` on a
    GET that names no job)."""
    errors: list[Any] = list(exc.errors()) if isinstance(exc, RequestValidationError) else []
    where = tuple(errors[0].get("loc", ())) if errors else ()
    if where and where[0] in ("query", "path", "header", "cookie"):
        name = ".".join(str(part) for part in where[1:]) or str(where[0])
        return error(400, "invalid_request", f"{name}: {errors[0].get('msg', 'invalid')}"[:300])
    return invalid_job(errors, "request")


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
    detail = getattr(exc, "detail", None) or "refused"
    if status == 404 and request.scope.get("route") is None:  # no such route: name it, as /v1/files does
        detail = (
            f"no route {request.method} {request.url.path[:200]}: GET /openapi.json lists mrc-api's routes"
        )
    headers = getattr(exc, "headers", None)
    return error(status, _HTTP_CODES.get(status, "invalid_job" if status < 500 else "internal_error"),
                 str(detail)[:300], headers)  # fmt: skip


def create_app(settings: Settings, queue: Queue | None = None) -> FastAPI:
    """The app; `queue` (a `Queue`, or a `producer.client.Client`) where the caller brings its own."""
    state = ApiState(settings, queue)
    openai = OpenAIRoutes(state)
    limiter = RateLimiter(settings.api_rate_per_s, settings.api_rate_burst)
    ops = OpsRoutes(settings, limiter)
    # The usage totals' own connection, no retries: a scrape while Redis is away answers at once (up 0).
    usage_redis = scrape_client(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        openai.start()
        yield
        openai.stop()
        ops.close()
        state.close()
        usage_redis.close()

    app = FastAPI(title="mrc intake", version="1", description=__doc__, lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    JobRoutes(state).mount(app)
    openai.mount(app)
    ops.mount(app)
    state.usage_registry.register(UsageCollector(usage_redis))
    keys = Keys(settings.api_keys)
    app.add_middleware(
        Front, keys=keys, limiter=limiter, limits=limits(settings), count=state.count,
        unavailable=state.count_unavailable,
    )  # fmt: skip
    app.add_middleware(OpenAIErrors)  # outermost: errors on the OpenAI routes leave in OpenAI's shape
    return app


def app_from_env() -> FastAPI:
    """The app for uvicorn's worker processes (`--factory`): each spawned process reads its settings
    and sets up its own logging here (a spawned process starts with none of its parent's)."""
    settings = Settings()
    logs.configure(settings.log_level, fmt=settings.log_format)
    return create_app(settings)


def main() -> int:
    from shared.settings import load

    try:
        settings = load()
        app = create_app(settings)
    except ValueError as exc:  # BadSettings, or a value create_app refuses (one line either way)
        print(f"mrc-api: bad settings: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, fmt=settings.log_format)
    log = logs.get_logger()
    if not Keys(settings.api_keys).enabled:
        log.warning("MRC_API_NO_AUTH", message="MRC_API_KEYS is empty: every caller may submit")
    try:
        reach.check(settings)
    except (ServiceUnreachable, StoreUnavailable, MrcError) as exc:
        print(f"mrc-api: {exc.message}", file=sys.stderr)
        return 5
    taken = _port_problem(settings.api_host, settings.api_port, settings.api_workers)
    if taken:  # said before "listening" and as a setting's fault (review: logged listening, then exit 3)
        print(f"mrc-api: bad settings: MRC_API_PORT {settings.api_port}: {taken}", file=sys.stderr)
        return 2
    if settings.api_workers > 1:  # uvicorn's supervisor binds the port and starts the processes
        log.info("MRC_HTTP_LISTENING", port=settings.api_port, what="mrc-api", workers=settings.api_workers)
    try:
        with _stops_as_exits():
            _serve(settings, app)
    except SystemExit as stop:
        return int(stop.code or 0)
    return 0


class _Stopped(SystemExit):
    """SIGTERM or SIGINT, once uvicorn has let go of it."""


@contextlib.contextmanager
def _stops_as_exits() -> Iterator[None]:
    """SIGTERM ends mrc-api with 0 and SIGINT with 130, as a stop it asked for. uvicorn drains, then
    raises the signal it caught again to the handler it found (review, helper-92: exit status 143
    after every graceful stop, which a supervisor counts as a crash); this is that handler. One that
    comes before uvicorn listens stops the start the same way."""
    codes: dict[int, int] = {signal.SIGTERM: 0, signal.SIGINT: 130}

    def stop(signum: int, _frame: object) -> None:
        raise _Stopped(codes[signum])

    before = {signum: signal.signal(signum, stop) for signum in codes}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _serve(settings: Settings, app: FastAPI) -> None:
    import uvicorn

    from producer.http.header_timeout import HeadersInTime

    options: dict[str, Any] = {
        "host": settings.api_host,
        "port": settings.api_port,
        "log_config": None,
        "http": HeadersInTime,  # a request head late past MRC_API_HEADER_TIMEOUT_S closes its connection
    }
    if settings.api_workers > 1:  # worker processes import the app themselves
        # Their counters in files of one folder, summed at every scrape (prometheus_client's multiprocess
        # mode): one port cannot show each process, and a scrape answered by one of them undercounted
        # and looked like counter resets (review).
        with tempfile.TemporaryDirectory(prefix="mrc-api-metrics-") as counters:
            os.environ[MULTIPROCESS_DIR] = counters
            uvicorn.run(
                "producer.server:app_from_env",
                factory=True,
                workers=settings.api_workers,
                access_log=False,
                **options,
            )
    else:
        _logged_stops()(uvicorn.Config(app, access_log=False, **options)).run()


def _logged_stops() -> type:
    import uvicorn

    class LoggedStops(uvicorn.Server):
        """uvicorn's server, saying when it listens and when a stop begins: from there it takes no
        new connection and answers those in hand first, a chat completion's wait included (review,
        helper-93: a stop that held for a minute said nothing)."""

        async def startup(self, sockets: Any = None) -> None:
            """Listening said once the port takes connections (review, helper-96: said before uvicorn
            bound it, a client that waited for the line was refused)."""
            await super().startup(sockets)
            if self.started:
                logs.get_logger().info("MRC_HTTP_LISTENING", port=self.config.port, what="mrc-api", workers=1)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                logs.get_logger().info(
                    "MRC_API_STOPPING",
                    signal=signal.Signals(sig).name,
                    connections=len(self.server_state.connections),
                )
            super().handle_exit(sig, frame)

    return LoggedStops


def _port_problem(host: str, port: int, workers: int = 1) -> str | None:
    """Why the API could not listen on host:port (taken, not this host's address), or None: every
    address uvicorn would bind, as it binds them. One process binds each address the name resolves
    to (review: only the first was tried, `localhost`'s ::1, and a taken 127.0.0.1 passed); several
    share one socket, IPv6 where the host has a `:`, else IPv4. A name that does not resolve is left
    to uvicorn to say."""
    addresses: list[tuple[Any, Any, int, Any]]
    if workers > 1:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        addresses = [(family, socket.SOCK_STREAM, 0, (host, port))]
    else:
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError:
            return None
        addresses = [(family, kind, proto, address) for family, kind, proto, _name, address in found]
    with contextlib.ExitStack() as held:  # all bound at once, as the server holds them
        for family, kind, proto, address in addresses:
            probe = held.enter_context(socket.socket(family, kind, proto))
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio binds
            try:
                probe.bind(address)
            except OSError as exc:
                return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


if __name__ == "__main__":
    sys.exit(main())
