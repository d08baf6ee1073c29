"""`mrc-worker`: load the model, warm it up, then consume the lanes with the batched task."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from shared import early_stop, logs, names, reach, redis_target
from shared.errors import MrcError, ServiceUnreachable, StoreRefused, StoreUnavailable
from shared.jobs import now_rfc3339
from shared.settings import BadSettings, Settings, unknown_variables
from shared.settings import load as load_settings

if TYPE_CHECKING:
    from workers import health

# torch, transformers, celery and the pipeline load in main, after the settings and the services are
# checked: a worker that cannot start says why in a fraction of a second, not after seconds of imports.


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mrc-worker",
        description="Consume mrc jobs from Redis in micro-batches, run Fuyu, write results to S3. "
        "All other settings come from MRC_* environment variables (see README.md).",
    )
    parser.add_argument(
        "--lanes",
        type=_lanes,
        default="interactive,backlog",
        help="comma-separated lanes, highest priority first (default: interactive,backlog)",
    )
    parser.add_argument("--hostname", default=None, help="worker name (default: mrc@<host>-<pid>)")
    return parser


def _lanes(value: str) -> list[str]:
    """--lanes read (argparse's type: a bad list is a usage error, exit 2, not exit 1: review)."""
    lanes = [lane.strip() for lane in value.split(",") if lane.strip()]
    unknown = [lane for lane in lanes if lane not in names.LANES]
    if not lanes or unknown:
        raise argparse.ArgumentTypeError(f"takes a comma-separated list of {', '.join(names.LANES)}")
    return lanes


def _refuse_readiness(reason: str, state: health.HealthState, log: Any, heartbeat: Any) -> int:
    """Stay alive but never ready (an orchestrator keeps traffic away and shows why), until SIGTERM;
    the heartbeat says why at once, then at every beat (`mrc queues`, the ops page)."""
    import contextlib
    import signal
    import threading

    import redis

    state.set_not_ready(reason)
    log.critical("MRC_NOT_READY", reason=reason)
    with contextlib.suppress(redis.RedisError):  # Redis away: the next beat says it
        heartbeat.beat()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    return 0


def _route_celery_console(log: Any) -> None:
    """Celery prints shutdown notices straight to the console; keep them in the one-line log format."""
    import celery.apps.worker as celery_worker

    def say(msg: str, f: object = None) -> None:
        log.info("MRC_CELERY_NOTICE", msg=msg.strip())

    celery_worker.safe_say = say


EXIT_USAGE, EXIT_UNREACHABLE, EXIT_UNUSABLE = 2, 5, 70


def _stop_while_starting(signum: int, _frame: object) -> None:
    """Without a handler, PID 1 of a container ignores SIGTERM: a worker stopped while it loads (a
    rollout, a scale-in) loaded on, took jobs, and was killed at the grace period's end with them in
    hand (review, helper-116). No job is held before Celery takes the signals over (as it starts
    consuming), so the worker ends here and now, 0 for SIGTERM and SIGHUP (which restarts it once it
    consumes), 130 for SIGINT. Not by an exception:
    one raised wherever the main thread was (inside torch's import, on a slow machine) left a library
    half-imported, which raised its own error and exited 1 with a traceback."""
    code = 130 if signum == signal.SIGINT else 0  # SIGHUP too: its supervisor starts it again
    logs.get_logger().info("MRC_WORKER_STOPPED", exit_code=code, while_starting=1)
    if "redis" in _starting:  # on a thread of its own, bounded: the main thread may hold a lock it needs
        held = [_starting.get(name) for name in ("server", "redis", "results", "heartbeat")]
        letting_go = threading.Thread(target=_let_go, args=held, daemon=True)
        letting_go.start()
        letting_go.join(timeout=3.0)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


_starting: dict[str, Any] = {}  # what a stop while starting lets go of (_let_go), as it is made


def _names_no_model(exc: OSError) -> bool:
    """An OSError that says MRC_MODEL names no model: no such path, or a folder without one (the
    words transformers uses), not a fault of the disk, the permissions or the network."""
    if isinstance(exc, FileNotFoundError | NotADirectoryError | IsADirectoryError):
        return True
    # transformers' words, offline as mrc always loads: a folder without the files, no such hub id in
    # the cache
    # the cache; a path that is not there read as a hub id (huggingface_hub's HFValidationError, a
    # ValueError, under transformers' OSError); a file that is not a model's config
    said = (
        "does not appear to have", "is not a local folder", "couldn't find them in the cached files",
        "Repo id must be in the form", "is not a valid JSON file",
    )  # fmt: skip
    return isinstance(exc.__cause__, ValueError) or any(words in str(exc) for words in said)


def _let_go(server: Any, redis_client: Any, results: Any = None, heartbeat: Any = None) -> None:
    """What a start refused before the model loads opened: the health server, the Redis and S3
    clients (a SIGHUP's restart runs in the same process: its port must be free again, and nothing
    is left for the garbage collector to warn about), the heartbeat (its entry gone with it)."""
    if heartbeat is not None:
        heartbeat.stop()
    if server is not None:
        server.shutdown()
        server.server_close()
    redis_client.close()
    connection = getattr(results, "connection", None)  # the S3 store's
    if connection is not None:
        connection.close()


# What the worker needs beyond the producer's packages (`pip install '.[worker]'`).
WORKER_MODULES = ("torch", "transformers", "celery_batches", "bitsandbytes", "xgrammar", "PIL")


def missing_modules(modules: Sequence[str]) -> list[str]:
    import importlib.util

    return [name for name in modules if importlib.util.find_spec(name) is None]


def main(argv: Sequence[str] | None = None) -> int:
    with early_stop.handled(_stop_while_starting, (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)):
        return _start(argv)


def _start(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    lanes: list[str] = args.lanes
    missing = missing_modules(WORKER_MODULES)
    if missing:  # a producer-only install: say what to install, not a traceback (review)
        print(
            f"mrc-worker: the worker's packages are not installed (no module {', '.join(missing)}): "
            "pip install -c constraints.txt '.[worker]' in the repository (README.md, \"Install\")",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        settings = load_settings()
    except BadSettings as exc:
        print(f"mrc-worker: bad settings: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure(settings.log_level, fmt=settings.log_format)
    log = logs.get_logger()
    for name in unknown_variables():
        log.warning("MRC_UNKNOWN_SETTING", name=name)
    try:  # before the model loads: minutes of loading for a worker that cannot work is no use
        reach.check(settings)
    except ServiceUnreachable as exc:
        log.critical("MRC_FATAL", error=exc.message)
        print(f"mrc-worker: {exc.message}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return _serve(args, settings, lanes, log)


def _serve(args: argparse.Namespace, settings: Settings, lanes: list[str], log: Any) -> int:
    """Load, warm up and consume until stopped; the exit code."""
    from celery.signals import worker_ready

    from shared import ops_counts, transport, transport_qos, unacked
    from shared.celery_app import make_celery
    from shared.lane_metrics import LaneCollector
    from shared.records import RedisJobRecords, connect, scrape_client
    from shared.stores import open_stores
    from workers import health, tasks
    from workers.backends import attention, make_backend
    from workers.cache import RedisResultCache
    from workers.gpu_metrics import GpuCollector
    from workers.heartbeat import Heartbeat
    from workers.liveness import Liveness
    from workers.metrics import Metrics
    from workers.pipeline import assemble
    from workers.streaming import RedisSink

    metrics = Metrics()
    for lane in lanes:
        metrics.lanes.labels(lane=lane).set(1)
    state = health.HealthState()
    lane_keys = [key for lane in lanes for key in names.queue_keys(lane)]
    depth_client = scrape_client(settings)  # liveness and the lane gauges: never held by a hung Redis
    _starting["redis"] = depth_client
    liveness = Liveness(
        settings.stuck_after_s,
        lambda: sum(int(depth_client.llen(key)) for key in lane_keys) > 0,
        consuming=False,  # loading, or alive but not ready on purpose: nothing to be stuck yet
    )
    transport.on_poll = liveness.polled
    transport.lane_limits = {
        names.queue_name("backlog"): (settings.worker_deliveries - 1) * settings.batch_max_jobs
    }
    try:
        server = health.serve(
            settings.metrics_port, state, metrics, liveness=liveness,
            redis_status=lambda: redis_target.status(settings),
        )  # fmt: skip
    except OSError as exc:  # the port taken (a second worker on the host): before the model loads
        message = f"MRC_METRICS_PORT {settings.metrics_port} cannot be served: {exc.strerror or exc}"
        log.critical("MRC_FATAL", error=message)
        print(f"mrc-worker: {message} (give each worker on a host its own port)", file=sys.stderr)
        _let_go(None, depth_client)
        return EXIT_USAGE
    _starting["server"] = server
    log.info("MRC_HTTP_LISTENING", port=server.server_address[1])
    images_from, results = open_stores(settings)
    _starting["results"] = results
    try:  # before the model loads, as the reach check: minutes of loading for a worker that cannot write
        results.ensure_bucket()
    except (StoreUnavailable, StoreRefused) as exc:
        log.critical("MRC_FATAL", error=exc.message)
        print(f"mrc-worker: {exc.message}", file=sys.stderr)
        _let_go(server, depth_client, results)
        return EXIT_UNREACHABLE

    # Seen from the start, not once ready: `mrc queues` and the ops page show a worker loading its
    # model (minutes) or refusing readiness, and why (review, helper-74: they showed no worker at all).
    hostname = args.hostname or f"mrc@{socket.gethostname()}-{os.getpid()}"
    state.set_not_ready("loading the model")
    starting = {"hostname": hostname, "lanes": lanes, "model": settings.model, "device": settings.device,
                "loaded": False}  # fmt: skip
    heartbeat = Heartbeat(
        connect(settings),
        hostname,
        lambda: {**starting, "ready": False, "not_ready_reason": state.reason, "jobs": 0},
        every_minute=lambda: ops_counts.sample_depth(depth_client),
    )
    heartbeat.start()
    _starting["heartbeat"] = heartbeat
    backend = make_backend(settings)
    began = time.perf_counter()
    try:
        backend.load()
    except (MrcError, OSError, ValueError) as exc:  # no such model, or not one (review: a traceback)
        said = exc.message if isinstance(exc, MrcError) else f"{type(exc).__name__}: {exc}"
        message = f"MRC_MODEL {settings.model!r} cannot be loaded: {' '.join(said.split())[:400]}"
        log.critical("MRC_FATAL", error=message)
        # The setting's fault (exit 2), or the machine's (a disk, a permission, a network: exit 70, as
        # an unusable worker's; review: every OSError read as bad settings).
        # The backend names the model in a ModelError raised from the OSError it met: the cause decides.
        cause = exc.__cause__ if isinstance(exc, MrcError) and isinstance(exc.__cause__, OSError) else exc
        settings_fault = not isinstance(cause, OSError) or _names_no_model(cause)
        print(f"mrc-worker: {'bad settings: ' if settings_fault else ''}{message}", file=sys.stderr)
        _let_go(server, depth_client, results, heartbeat)
        return EXIT_USAGE if settings_fault else EXIT_UNUSABLE
    log.info("MRC_MODEL_LOADED", seconds=round(time.perf_counter() - began, 3), **backend.describe())
    began = time.perf_counter()
    try:
        kernel = backend.warm_up()
    except Exception as exc:  # loaded but cannot run here (review, helper-116: a traceback, exit 1)
        said = " ".join(str(exc).split())[:400]
        message = f"the model cannot run on this machine: {type(exc).__name__}: {said}"
        log.critical("MRC_FATAL", error=message)  # e.g. Triton's grammar kernel without a C compiler
        print(f"mrc-worker: {message}", file=sys.stderr)
        _let_go(server, depth_client, results, heartbeat)
        return EXIT_UNUSABLE
    log.info(
        "MRC_WARMED_UP", seconds=round(time.perf_counter() - began, 3), attention_kernel=kernel,
        attention_kernel_decode=backend.describe().get("attention_backend_decode", ""),
    )  # fmt: skip
    if settings.require_fast_attention and kernel not in attention.FAST_KERNELS:
        refused = _refuse_readiness(
            f"attention kernel {kernel!r} is not a fast kernel", state, log, heartbeat
        )
        heartbeat.stop()
        return refused

    records = RedisJobRecords.from_settings(settings)
    app = make_celery(settings)
    cache = RedisResultCache(connect(settings))
    streams = RedisSink(
        connect(settings, settings.connect_timeout_s, retries=1), settings.stream_ttl_s, backend.model_id
    )
    pipeline = assemble(
        backend, images_from, results, records, settings,
        metrics=metrics, requeue=tasks.make_requeue(app), cache=cache, worker=hostname, streams=streams,
    )  # fmt: skip
    liveness.watch(lambda: (pipeline.progress_at, pipeline.batch_since), pipeline.live)
    fatal_client = connect(settings, settings.connect_timeout_s, retries=1)

    def on_fatal(reason: str) -> None:
        state.set_not_ready(f"unusable: {reason}")
        metrics.ready.set(0)

    def give_back() -> int:
        transport.stop_taking()  # first: a pop could take a message given back into this process again
        return unacked.give_back(fatal_client, transport_qos.held_by_this_process())

    tasks.register(app, settings, pipeline, give_back, on_fatal=on_fatal)
    metrics.registry.register(LaneCollector(depth_client))
    metrics.registry.register(GpuCollector(backend.device))
    metrics.watch(
        buffered=lambda: tasks.buffered(app),
        batch_for=lambda: pipeline.batch_for_s,
    )

    started_at = now_rfc3339()  # a model's `created` on GET /v1/models: its oldest worker's start
    heartbeat.describe = lambda: {
        "hostname": hostname,
        "started_at": started_at,
        "lanes": lanes,
        **backend.describe(),
        "jobs": pipeline.jobs_seen,
        "busy_ratio": round(pipeline.busy_ratio, 4),
        **pipeline.describe(),
        **pipeline.live(),
        "buffered": tasks.buffered(app),
        "batch_in_progress_s": round(pipeline.batch_for_s or 0.0, 1) or None,
        "ready": state.readiness() is not None,
        "not_ready_reason": None if state.readiness() is not None else state.reason,
        "stuck_after_s": settings.stuck_after_s,
        **_gpu_memory(backend.device),
    }
    state.set_ready({**backend.describe(), **pipeline.describe()})
    metrics.ready.set(1)
    log.info("MRC_WORKER_READY", hostname=hostname, lanes=",".join(lanes), **backend.describe())
    _route_celery_console(log)

    def on_consuming(**_: Any) -> None:
        liveness.consuming()
        log.info("MRC_CONSUMING", hostname=hostname)

    worker_ready.connect(on_consuming, weak=False)
    worker = app.Worker(
        hostname=hostname,
        queues=[names.queue_name(lane) for lane in lanes],
        # Deliveries run on their own threads, the consumer keeps fetching, and the engine's thread runs
        # the model for all of them; backlog messages never fill the last delivery's worth of room.
        pool="threads",
        # One thread per message it may hold (prefetch multiplier 1): a delivery can be a single
        # message, and a ticket's must never wait for a thread that backlog deliveries all hold.
        concurrency=settings.worker_deliveries * settings.batch_max_jobs,
        loglevel="WARNING",  # Celery's own chatter; our events have their own level (MRC_LOG_LEVEL)
        quiet=True,
        without_gossip=True,
        without_mingle=True,
        without_heartbeat=True,
    )
    worker.start()
    heartbeat.stop()
    state.set_not_ready()
    pipeline.close()
    server.shutdown()
    code = int(worker.exitcode or 0)
    log.info("MRC_WORKER_STOPPED", exit_code=code)
    return _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """End the stopped worker without tearing the interpreter down: measured, the teardown of the
    loaded model's and libraries' objects took 1.5-2 s of CPU after MRC_WORKER_STOPPED (a rolling
    restart's, a scale-down's, every test worker's stop). Nothing is left to do: the jobs are acked or
    given back, the engine and pools are closed, and the log is flushed here. The exit handlers still
    run: Celery's SIGHUP restart is one (it execs the worker again from there)."""
    import atexit
    import contextlib
    import logging

    atexit._run_exitfuncs()  # what a normal exit runs first; the teardown after it is what is skipped
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing more to say
            stream.flush()
    os._exit(code)


def _gpu_memory(device: str) -> dict[str, int]:
    """The GPU memory torch holds and the device's total, for the ops page (nothing on a CPU)."""
    if not device.startswith("cuda"):
        return {}
    import torch

    return {
        "gpu_memory_allocated_bytes": int(torch.cuda.memory_allocated(device)),
        "gpu_memory_total_bytes": int(torch.cuda.get_device_properties(device).total_memory),
    }


if __name__ == "__main__":
    sys.exit(main())
