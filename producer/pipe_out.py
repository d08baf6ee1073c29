"""stdout that a reader may close early (`mrc backlog status RUN --json | head -c 300`): what is
written after the reader left is dropped, and the command runs to its end and exits with its own
code. Python raised BrokenPipeError at the next print, a traceback; a `mrc backlog` piped into
`head -1` for its run id would have stopped enqueueing there (review)."""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO


class ReaderMayLeave:
    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.left = False

    def write(self, text: str) -> int:
        if not self.left:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.left:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        self.left = True
        # The interpreter flushes stdout as it exits: the descriptor goes to /dev/null, so that last
        # flush has nothing to fail on either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_stdout() -> None:
    if not isinstance(sys.stdout, ReaderMayLeave):
        sys.stdout = ReaderMayLeave(sys.stdout)
