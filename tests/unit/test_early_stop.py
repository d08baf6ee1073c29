"""A console script stopped while it imports itself ends at once with the code its main gives, as PID 1
of a container too, where a process without a handler ignores the signal (review, helper-117: a
worker SIGTERMed 0.05-0.2 s after it started, as PID 1, loaded on and took jobs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    ("mrc-worker", "workers", "SIGTERM", 0),
    ("mrc-worker", "workers", "SIGHUP", 0),
    ("mrc-worker", "workers", "SIGINT", 130),
    ("mrc", "producer", "SIGTERM", 143),
    ("mrc-api", "producer", "SIGTERM", 0),
]


@pytest.mark.parametrize(("script", "package", "signame", "code"), CASES)
def test_a_stop_while_the_package_is_imported_ends_the_script_with_its_code(
    script: str, package: str, signame: str, code: int
) -> None:
    program = (
        f"import os, signal, sys; sys.argv[0] = '/venv/bin/{script}'; import {package}; "
        f"os.kill(os.getpid(), signal.{signame}); signal.pause()"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == code, done.stderr


def test_any_other_program_importing_the_packages_keeps_its_own_signals() -> None:
    program = (
        "import signal, sys; sys.argv[0] = 'pytest'; import workers, producer; "
        "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL; "
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("module", ["producer.cli", "workers.cli"])
def test_a_main_called_in_a_process_that_goes_on_leaves_its_signals_as_they_were(module: str) -> None:
    """A fresh clone's CI lost two pytest workers: tests call these mains in their own process, and
    the handlers they left ended that process at its next signal."""
    import importlib
    import signal

    cli = importlib.import_module(module)
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert {signum: signal.getsignal(signum) for signum in before} == before
