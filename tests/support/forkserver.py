"""A fork server for the test session: `mrc` and `mrc-worker` processes forked from one that has
imported them already, instead of each new process importing torch, transformers, bitsandbytes,
boto3 and celery again.

Why: `make test` is CPU-bound on two cores, and the imports were most of it. Measured here: an
`mrc-worker` start took ~7.2 CPU-s to MRC_CONSUMING (torchvision pulls in torch._dynamo, bitsandbytes
torch._inductor, transformers scans its model folders), forked from a process holding those modules
~0.9 CPU-s; an `mrc submit` ~1.1 CPU-s. The suite starts ~50 workers and ~150 commands.

Each child is still a process of its own, as a test needs: its own pid, environment, working folder,
stdin/stdout/stderr, session, signals and exit code, and it ends through the interpreter's normal exit
(threads joined, atexit handlers run), not os._exit. What it shares with the server is only what
importing the modules did, so the server runs with the environment the tests' processes get, less the
variables read when a command runs (MRC_* settings, AWS_* credentials), and `spawn` refuses (the
caller starts a plain process) a request whose environment differs from it anywhere else: a variable
read at import time (OMP_*, HF_*, PYTHON*) could otherwise be the server's instead of the test's.

Protocol, one Unix-socket connection per process: the client sends one JSON line (program, args, env,
cwd, stdout/stderr paths, session), the server answers {"pid": N} once forked and {"returncode": N}
when it has reaped the child (negative: the signal that ended it, as subprocess reports it).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The programs a child may run: console script name -> the module whose main() it is (pyproject.toml).
PROGRAMS = {"mrc": "producer.cli", "mrc-worker": "workers.cli"}
# Imported by a server before it forks anything: what the programs import when they run. Two servers:
# `light` holds no torch, for `mrc` (the producer side runs without it) and workers on the echo model
# (which load none: tests/faults/test_faults.py checks their maps); `model` adds what a Fuyu worker
# loads. `workers` first: it sets OMP_WAIT_POLICY before torch loads OpenMP, as in a worker of its own.
LIGHT = (
    "workers",
    "workers.cli",
    "workers.pipeline",
    "workers.tasks",
    "celery.worker",
    "celery_batches",
    "shared.celery_app",
    "shared.stores",
    "producer.cli",
    "producer.client",
    "producer.ops.queues",
    # Imported when a command or worker first reaches S3 or Redis, not when it loads: left out, each
    # forked `mrc` imported boto3 again (~0.16 CPU-s of its ~0.5).
    "shared.stores.s3",
    "shared.transport",
    "kombu.matcher",
    "workers.health",
)
MODEL = (
    *LIGHT,
    "workers.backends.fuyu",  # before transformers: it sets HF_HUB_OFFLINE & co. that hub reads at import
    "torch",
    "torchvision.transforms.v2.functional",
    "torchvision.io",
    "bitsandbytes",
    "transformers.integrations.bitsandbytes",
    "transformers.models.fuyu.modeling_fuyu",
    "transformers.models.fuyu.processing_fuyu",
    "workers.engine.runner",
    "xgrammar",
)
PRELOADS = {"light": LIGHT, "model": MODEL}
# Read when a command runs, never at import: these may differ between the server and a request.
PER_CALL = ("MRC_", "AWS_")


def import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(PER_CALL)}


# --- the server -------------------------------------------------------------------------------------


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):  # a client that gave up on its process
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            conn.close()


def serve(path: str) -> dict[str, Any]:
    """Accept requests until stdin closes (the test session gone), then exit; return only in a child,
    with the request it is to run."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    print("ready", flush=True)
    while True:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is sys.stdin:
                if not os.read(sys.stdin.fileno(), 4096):  # the session ended: its children are its own
                    os.unlink(path)
                    sys.exit(0)
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                try:  # a client gone before its request (interrupted) costs its own start only
                    conn.settimeout(10)
                    request = json.loads(_read_line(conn))
                except (OSError, ValueError) as exc:
                    print(f"a request that could not be read: {exc!r}", file=sys.stderr, flush=True)
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    for open_socket in (listener, conn, *children.values()):
                        open_socket.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    return dict(request)
                children[pid] = conn
                conn.settimeout(None)
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            else:
                os.read(wake_r, 4096)
        _reap(children)  # also on the timeout: a wakeup byte lost to a full pipe loses no child


def _redirect(fd: int, path: str | None, flags: int) -> None:
    target = os.open(path or os.devnull, flags, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _name(program: str) -> None:
    """The process's name (comm: what `pgrep mrc-worker` and ps show) the program's, as exec gives it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(15, program.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def run(request: dict[str, Any], added: Mapping[str, str]) -> int:
    """In the child: become the process the request describes and run its program's main()."""
    if request["session"]:
        os.setsid()
    os.chdir(request["cwd"])
    _redirect(0, None, os.O_RDONLY)
    append = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    _redirect(1, request["stdout"], append)
    if request["stderr"] == "stdout":
        os.dup2(1, 2)
    else:
        _redirect(2, request["stderr"], append)
    os.environ.clear()
    os.environ.update(request["env"])
    program = request["program"]
    if program == "mrc-worker":  # what importing the worker's modules set (setdefault), as here
        for name, value in added.items():
            os.environ.setdefault(name, value)
    sys.argv = [request["argv0"], *request["args"]]
    sys.path[0] = os.path.dirname(request["argv0"])  # a console script's, not the server's folder
    _name(program)
    main = importlib.import_module(PROGRAMS[program]).main
    return int(main() or 0)


def _warm_boto3() -> None:
    """boto3's default session with the S3 model and endpoint rules loaded: each forked command made
    two or three S3 clients, the first ~0.1 CPU-s of JSON parsing, forked from here ~0.01 s. Only the
    data files are cached: the client is made with its own region and keys, so the session resolves no
    credentials and reads no region of the server's; a child's clients take those from its own
    environment when it makes them (tests/integration/test_forkserver.py checks a child's keys)."""
    import boto3

    boto3.setup_default_session()
    boto3.client(
        "s3",
        region_name="us-east-1",
        endpoint_url="http://127.0.0.1:9",
        aws_access_key_id="fork-server",
        aws_secret_access_key="fork-server",
    ).close()


def _server_main(path: str, kind: str) -> None:
    before = dict(os.environ)
    for module in PRELOADS[kind]:
        importlib.import_module(module)
    if kind == "light" and "torch" in sys.modules:
        raise SystemExit("the light fork server imported torch: a producer-side module pulls it in")
    added = {k: v for k, v in os.environ.items() if k not in before}
    _warm_boto3()
    request = serve(path)
    sys.exit(run(request, added))


# --- the client (the test session) ------------------------------------------------------------------


def _readable(fd: int, timeout_s: float) -> bool:
    """poll(2), not select(2): a test process may hold more than select's 1,024 descriptors."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


class ForkedProcess:
    """What a test uses of subprocess.Popen, for a process the server forked. A pidfd holds the
    process: signals never reach a pid reused after it ended, and poll() says None only while it
    runs (the server's word on its exit code may lag its end by a moment: waited for then)."""

    def __init__(self, conn: socket.socket, args: list[str]) -> None:
        self._conn = conn
        self._buffer = b""
        self.args = args
        self.returncode: int | None = None
        first = self._message(timeout=60)
        if first is None or "pid" not in first:
            raise RuntimeError(f"fork server did not start {args}: {first}")
        self.pid = int(first["pid"])
        self._pidfd = os.pidfd_open(self.pid)  # before the child can end: the server reaps it only later

    def _message(self, timeout: float | None) -> dict[str, Any] | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._conn.settimeout(left)
            try:
                chunk = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                raise RuntimeError(f"fork server went away while {self.args} ran")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return dict(json.loads(line))

    def _ended(self) -> bool:
        return _readable(self._pidfd, 0)

    def _settle(self, timeout: float | None) -> None:
        if self.returncode is None:
            message = self._message(60 if self._ended() else timeout)
            if message is not None:
                self.returncode = int(message["returncode"])
                self._conn.close()
                os.close(self._pidfd)

    def poll(self) -> int | None:
        self._settle(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._settle(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # through the pidfd, whatever became of the server
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def __del__(self) -> None:  # as Popen's: a process nobody waited for leaves nothing open
        self._conn.close()
        if self.returncode is None:
            os.close(self._pidfd)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One server process (`light` or `model`) and its socket; `spawn` forks a program from it."""

    def __init__(self, kind: str, env: Mapping[str, str], folder: Path, log_path: Path) -> None:
        self.path = str(folder / f"{kind}.sock")
        with log_path.open("ab") as log:
            # A session of its own: a Ctrl-C to the tests' terminal is not the server's (it would leave
            # the workers it forked to no one).
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.forkserver", self.path, kind],
                env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=ROOT,
                start_new_session=True,
            )  # fmt: skip
        assert self.proc.stdout is not None
        ready = _readable(self.proc.stdout.fileno(), 300)  # imports on a busy machine
        if not ready or self.proc.stdout.readline().strip() != b"ready":
            self.close()
            raise RuntimeError(f"the {kind} fork server did not start: see {log_path}")

    def spawn(self, request: dict[str, Any]) -> ForkedProcess:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        conn.sendall(json.dumps(request).encode() + b"\n")
        return ForkedProcess(conn, [request["argv0"], *request["args"]])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the server exits at the end of its stdin
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class ForkServers:
    """What scripts/devservices.py calls as its `fork` (see there): each server started at its first
    use, for the environment given here (the session's), and the one a program needs chosen."""

    def __init__(self, env: Mapping[str, str], log_path: Path) -> None:
        self.env = import_time_env(env)
        self.log_path = log_path
        # AF_UNIX names hold 108 bytes: /tmp, whatever TMPDIR says
        self.folder = Path(tempfile.mkdtemp(prefix="mrc-fork-", dir="/tmp"))
        self.broken: set[str] = set()
        self.servers: dict[str, ForkServer] = {}
        # Tests start workers from several threads at once (the parcels test, two): without it both
        # started the model server on the same socket, the second failed to bind, and every model
        # worker of the session after it was a plain process (~7 CPU-s more each).
        self._starting = threading.Lock()

    def __call__(
        self, program: str, args: Sequence[str], env: Mapping[str, str], *, argv0: str,
        stdout: str | None, stderr: str | None, session: bool = False,
    ) -> ForkedProcess | None:  # fmt: skip
        """The program forked, or None where no server can serve `env` (see the module's docstring)."""
        if program not in PROGRAMS:
            return None
        differs = sorted(k for k in {*import_time_env(env), *self.env} if env.get(k) != self.env.get(k))
        if differs:  # said in the log: a suite that quietly stopped forking is minutes slower
            with self.log_path.open("a") as log:
                log.write(f"a plain {program}: its environment differs from the servers' in {differs}\n")
            return None
        kind = "model" if program == "mrc-worker" and env.get("MRC_MODEL") != "echo" else "light"
        if kind in self.broken:
            return None
        request = {
            "program": program, "argv0": argv0, "args": list(args), "env": dict(env), "cwd": os.getcwd(),
            "stdout": stdout, "stderr": stderr, "session": session,
        }  # fmt: skip
        try:
            with self._starting:
                if kind in self.broken:
                    return None
                if kind not in self.servers:
                    self.servers[kind] = ForkServer(kind, self.env, self.folder, self.log_path)
                server = self.servers[kind]
            return server.spawn(request)
        except (OSError, RuntimeError) as exc:  # said in the log, and plain processes from now on
            self.broken.add(kind)
            with self.log_path.open("a") as log:
                log.write(f"the {kind} fork server cannot serve: {exc!r}; plain processes from now on\n")
            return None

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        shutil.rmtree(self.folder, ignore_errors=True)


if __name__ == "__main__":
    _server_main(sys.argv[1], sys.argv[2])
