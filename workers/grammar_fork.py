"""A grammar compile in a forked child, killed at its time limit.

The grammar library compiles a format in one native call that cannot be interrupted: a compile past
MRC_GRAMMAR_COMPILE_TIMEOUT_S ran on in its thread for as long as it took (30-40 s for a pattern's
`{1,16000}` on a 448-token vocabulary, far longer on Fuyu-8B's), holding a CPU and a compile place.
Eight such formats from one key filled every place, and another key's small schemas waited, were
retried and failed for good (review, helper-84). In a child the compile is stopped at the limit.

A fork, not a spawned process: the child has the compiler's vocabulary already (a spawned one would
import the library and torch, seconds per compile) and costs a few milliseconds. The child makes its
own compiler (nothing it shares with a thread of the parent mid-compile), compiles, writes the
serialized grammar to a pipe and leaves with os._exit (no atexit, no buffers of the parent flushed
twice); it never touches the device, logs or imports. The parent reads the pipe until it closes or the
limit passes, then kills and reaps the child.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
import warnings
from collections.abc import Callable

# Python 3.12 warns on every fork of a threaded process; the child here only compiles and exits.
warnings.filterwarnings(
    "ignore", message=r".*multi-threaded, use of fork\(\) may lead to deadlocks", category=DeprecationWarning
)

_OK, _FAILED = b"K", b"E"
_EXIT_GRACE_S = 2.0  # from the end of its pipe to the end of the child: os._exit, at once
_READ = 1 << 20


class TimedOut(Exception):
    """The compile ran past its limit and was stopped."""


class ChildFailed(Exception):
    """The compile raised in the child: its message is the library's reason."""


class ChildDied(Exception):
    """The child ended without an answer (a signal, the OOM killer): nothing is known of the format."""


# Fork one child at a time, and close the parent's write end of its pipe before the next fork: a child
# forked while another compile's write end was open held it, and that compile saw no end of its pipe
# until the other child ended, then timed out (review, helper-85: 8 of 14 cheap formats beside a costly
# one failed "did not compile within 4 s", then were refused for 5 minutes).
_FORKING = threading.Lock()


def run(work: Callable[[], str], limit_s: float) -> str:
    """What `work` returns, computed in a forked child within `limit_s`; TimedOut past it,
    ChildFailed with the child's error, OSError when no child can be made (the caller compiles here)."""
    parent = os.getpid()
    with _FORKING:
        read_end, write_end = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(read_end)
            os.close(write_end)
            raise
        if pid == 0:  # the child: compile, write, leave; nothing else
            _child(work, write_end, parent)
        os.close(write_end)
    data: bytes | None = None
    try:
        data = _read_until(read_end, time.monotonic() + limit_s)
    finally:
        os.close(read_end)
        status = _reap(pid, _EXIT_GRACE_S if data is not None else 0.0)
    if data is None:
        raise TimedOut(f"past {limit_s:g} s")
    if data[:1] == _OK:
        return data[1:].decode()
    if data[:1] == _FAILED:
        raise ChildFailed(data[1:].decode(errors="replace"))
    raise ChildDied(f"the compile's process ended without an answer ({status})")


def _child(work: Callable[[], str], fd: int, parent: int) -> None:
    code = 0
    try:
        # Ctrl-C reaches the whole process group: the child must not answer "does not compile" for it,
        # nor run the worker's handlers (Celery's logged a second warm shutdown from the child: review,
        # helper-85); the parent kills it when it must, and it ends with the parent, whatever ends that.
        for number in signal.valid_signals():
            if callable(signal.getsignal(number)) or number in (signal.SIGINT, signal.SIGTERM):
                signal.signal(number, signal.SIG_IGN)
        _die_with_parent()
        _close_all_but(fd)  # the worker's sockets and files are not the child's to hold
        if os.getppid() != parent:  # it died before the line above: nobody waits for this compile
            os._exit(1)
        try:
            out = _OK + work().encode()
        except BaseException as exc:  # the reason goes to the parent, whatever it is
            out = _FAILED + f"{type(exc).__name__}: {exc}".encode(errors="replace")[:2000]
        view = memoryview(out)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _close_all_but(keep: int) -> None:
    """Every descriptor above stderr but `keep` closed: a child that outlived its worker kept its
    listening socket and its connections (review, helper-85)."""
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG (Linux): SIGKILL when the worker that forked this child dies, so no compile
    outlives the deadline its parent was keeping."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's kill at the deadline still holds
        pass


def _read_until(fd: int, deadline: float) -> bytes | None:
    """Everything the child writes until it closes the pipe, or None past the deadline (read as it
    comes: a grammar larger than the pipe's buffer would otherwise block the child forever)."""
    chunks: list[bytes] = []
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if not poller.poll(max(1, int(left * 1000))):
            continue
        chunk = os.read(fd, _READ)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _reap(pid: int, grace_s: float) -> str:
    """The child gone, whatever it was doing: given `grace_s` to end (its pipe closes a moment before
    it does), killed if it still runs, then waited for (no zombie). Returns how it ended, in words."""
    until = time.monotonic() + grace_s
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
        while done == 0 and time.monotonic() < until:
            time.sleep(0.005)
            done, status = os.waitpid(pid, os.WNOHANG)
        if done == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "killed" if grace_s else "killed at its limit"
    except ChildProcessError:  # reaped already (a SIGCHLD handler set to ignore): nothing left
        return "reaped elsewhere"
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"
