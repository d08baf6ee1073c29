"""A stop asked for while a console script imports itself (~0.4 s before its `main` installs its own
handlers): PID 1 of a container ignores a signal it has no handler for, so SIGTERM in that window was
lost and the process ran on, a worker loading its model and taking jobs (review, helper-117). Installed
from the package's `__init__`, only when the process is that console script, and only signals; nothing
is held yet, so the process ends at once with the code its `main` would give."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def install(script: str, codes: dict[signal.Signals, int]) -> None:
    """When this process runs `script` (its argv[0]'s name), each signal in `codes` ends it so."""
    if os.path.basename(sys.argv[0] if sys.argv else "") != script:
        return
    for signum, code in codes.items():
        signal.signal(signum, lambda _signum, _frame, code=code: os._exit(code))  # type: ignore[misc]


@contextlib.contextmanager
def handled(handler: Callable[[int, Any], None], signums: Iterable[signal.Signals]) -> Iterator[None]:
    """`handler` for each signal while the block runs, and what was there before once it ends: a main
    called by a process that goes on (the tests call them in theirs) leaves no handler behind, one that
    ended that process at the next signal it got (a fresh clone's CI lost two pytest workers so)."""
    before = {signum: signal.getsignal(signum) for signum in signums}
    for signum in before:
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, previous in before.items():
            signal.signal(signum, previous)
