"""mrc-api's command line before the server starts: a stop asked for while it imports is a stop."""

from __future__ import annotations

import signal

import pytest

from producer import api_cli


def test_a_signal_before_the_server_takes_them_over_exits_as_a_stop() -> None:
    """Review, helper-94: SIGTERM in the first second (the server's imports) ended with status 143 and
    SIGINT with a KeyboardInterrupt traceback; after it, 0 and 130."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(SystemExit):
            api_cli.main(["--help"])  # the handlers are in place before anything else runs
        for signum, code in ((signal.SIGTERM, 0), (signal.SIGINT, 130)):
            handler = signal.getsignal(signum)
            assert callable(handler)
            with pytest.raises(SystemExit) as stopped:
                handler(signum, None)
            assert stopped.value.code == code
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
