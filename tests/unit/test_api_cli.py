"""mrc-api's command line before the server starts: a stop asked for while it imports is a stop."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from producer import api_cli


@pytest.mark.parametrize(("signame", "code"), [("SIGTERM", 0), ("SIGINT", 130)])
def test_a_signal_before_the_server_takes_them_over_exits_as_a_stop(signame: str, code: int) -> None:
    """Review, helper-94: SIGTERM in the first second (the server's imports) ended with status 143 and
    SIGINT with a KeyboardInterrupt traceback; after it, 0 and 130. The handler ends the process at
    once (helper-117: an exception raised inside an import can leave a library half-imported), so it
    runs in a process of its own here."""
    program = (
        "import os, signal; from producer import api_cli; "
        f"signal.signal(signal.{signame}, api_cli._stop_while_starting); "
        f"os.kill(os.getpid(), signal.{signame}); signal.pause()"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stderr) == (code, "")


def test_main_holds_the_handlers_while_it_runs_and_leaves_none_behind() -> None:
    """In place before anything else runs (--help is the first thing main does), and the process's own
    handlers back once it returns: a main called in a process that goes on (as the tests call them)
    left a handler that ended that process at its next signal (a fresh clone's CI lost two pytest
    workers so)."""
    seen: list[object] = []
    before = signal.getsignal(signal.SIGTERM)
    original = api_cli._parser

    def parser() -> object:
        seen.append(signal.getsignal(signal.SIGTERM))
        return original()

    api_cli._parser = parser  # type: ignore[assignment]
    try:
        with pytest.raises(SystemExit):
            api_cli.main(["--help"])
    finally:
        api_cli._parser = original
    assert seen == [api_cli._stop_while_starting]
    assert signal.getsignal(signal.SIGTERM) is before
