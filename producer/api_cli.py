"""`mrc-api`'s command line: `--help`, a clear line when the API's packages are not installed, then the
server (producer/server.py). Its settings come from MRC_* environment variables only, so that one
container spec serves every replica; nothing here imports FastAPI until it is known to be there."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import sys
from collections.abc import Sequence

from shared import early_stop

EXIT_USAGE = 2
API_MODULES = ("fastapi", "uvicorn", "multipart")  # `pip install '.[api]'`


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="mrc-api",
        description="The HTTP intake: mrc's own routes (/v1/jobs, /v1/events, /ops) and the "
        "OpenAI-compatible ones (/v1/chat/completions, /v1/files, /v1/batches). Every setting comes "
        "from MRC_* environment variables (README.md, Settings): MRC_API_HOST, MRC_API_PORT, "
        "MRC_API_WORKERS, MRC_API_KEYS, MRC_REDIS_URL, MRC_S3_BUCKET, ...",
    )


def _stop_while_starting(signum: int, _frame: object) -> None:
    """A stop asked for before the server takes the signals over (its imports take ~1 s): exit as a
    stop after it does, 0 for SIGTERM and 130 for SIGINT (review, helper-94: 143, or a traceback).
    At once and not by an exception, which, raised inside an import, can leave a library half-imported
    and its own error in its place (the worker's, helper-117); nothing is held yet."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(0 if signum == signal.SIGTERM else 130)


def main(argv: Sequence[str] | None = None) -> int:
    with early_stop.handled(_stop_while_starting, (signal.SIGTERM, signal.SIGINT)):
        return _start(argv)


def _start(argv: Sequence[str] | None) -> int:
    _parser().parse_args(argv)  # --help, and no argument taken silently (review: --help started it)
    missing = [name for name in API_MODULES if importlib.util.find_spec(name) is None]
    if missing:  # a producer-only install: what to install, not a traceback (review)
        print(
            f"mrc-api: the API's packages are not installed (no module {', '.join(missing)}): "
            "pip install -c constraints.txt '.[api]' in the repository (README.md, \"Install\")",
            file=sys.stderr,
        )
        return EXIT_USAGE
    from producer import server

    return server.main()


if __name__ == "__main__":
    sys.exit(main())
