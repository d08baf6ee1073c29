"""SIGTERM taken as Ctrl-C is: the command stops where it is, says how to go on, and exits 143 (130 for
Ctrl-C). A process without its own handler ignores SIGTERM as PID 1 of a container, so `mrc backlog` in
a Kubernetes CronJob whose Job was deleted, or past its deadline, went on until the grace period's
SIGKILL and said nothing (review, helper-116, on the worker; the same class here)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

from shared import early_stop

EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # as a shell reports a command SIGINT / SIGTERM stopped


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt is: every place that handles one handles both."""


def _terminate(_signum: int, _frame: object) -> None:
    raise Terminated


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_taken() -> Iterator[None]:
    """SIGTERM raises Terminated, and SIGINT KeyboardInterrupt, while the command runs (and each is as
    it was after it). SIGINT too: the package's import put an immediate exit in place for the `mrc`
    script (shared/early_stop.py), and left there, Ctrl-C ended every command without a word: the job
    `mrc submit --wait` had queued went unnamed, a push it stopped left its claim unsettled, and `mrc
    backlog` never said how to go on (review, helper-123; tests call main in-process, where that
    handler is never installed)."""
    with early_stop.handled(_terminate, (signal.SIGTERM,)), early_stop.handled(_interrupt, (signal.SIGINT,)):
        yield


def exit_code(stop: KeyboardInterrupt) -> int:
    return EXIT_TERMINATED if isinstance(stop, Terminated) else EXIT_INTERRUPTED
