"""Start and stop real local services on free loopback ports: redis-server, moto's S3 server and
mrc-worker processes. `make demo` and the test suite both use it; nothing here is needed in
production, where Redis, S3 and the workers are deployed services.

A service that cannot start raises: nothing is silently skipped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shared.logs import parse_line


class Process(Protocol):
    """What the tests use of a started process: subprocess.Popen's, or a forked one's."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Set by the test session (tests/support/forkserver.py, tests/conftest.py): starts `mrc` or `mrc-worker`
# forked from a process that imported it already, or returns None where it cannot serve the
# environment (a plain process then). None here: the demo and the benchmarks start plain processes.
fork: Callable[..., Process | None] | None = None
# What base_env starts from: this process's environment, or a copy the test session took before its own
# imports added to it (torch, transformers and the worker's modules set variables when imported): a
# worker's environment is then the same in every test, whatever ran before it in the same process.
environ: Mapping[str, str] = os.environ


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(check: Callable[[], bool], timeout: float, what: str, proc: Process | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not come up within {timeout:g} s")


def _wait_or_stop(check: Callable[[], bool], timeout: float, what: str, proc: Process) -> None:
    """Wait for a service to come up; if it does not, or we are interrupted, leave nothing running."""
    try:
        wait_for(check, timeout, what, proc)
    except BaseException:
        stop(proc, signal.SIGKILL)
        raise


def stop(proc: Process, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.wait(0)  # its exit code (settled above)


@dataclass
class Service:
    proc: subprocess.Popen[bytes]
    url: str
    port: int
    log_path: Path

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return stop(self.proc, sig)


def start_redis(workdir: Path, appendonly: bool = False, port: int | None = None, tls: Any = None) -> Service:
    """A redis-server on loopback. `tls` (tests/support/tls.Certificates): TLS only, no plain port;
    its URL is rediss:// and names the CA to trust. On a free port, tried up to three times (as
    `start_s3`: the port may be taken between `free_port` and the bind)."""
    if port is not None:
        return _start_redis(workdir, appendonly, port, tls)
    for attempt in range(3):
        try:
            return _start_redis(workdir, appendonly, free_port(), tls)
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _start_redis(workdir: Path, appendonly: bool, port: int, tls: Any) -> Service:
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server is not installed (make install puts it there through apt)")
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"redis-{port}.log"
    args = [exe, "--bind", "127.0.0.1", "--dir", str(workdir), "--save", ""]
    if tls is None:
        args += ["--port", str(port)]
    else:
        args += ["--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"]
        args += [
            "--tls-cert-file",
            str(tls.cert),
            "--tls-key-file",
            str(tls.key),
            "--tls-ca-cert-file",
            str(tls.ca),
        ]
    args += ["--appendonly", "yes", "--appendfsync", "everysec"] if appendonly else ["--appendonly", "no"]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)

    def ping() -> bool:
        # Its own line first: a PING another test's server on the same port answers (both given it by
        # free_port, this one then failing to bind) must not pass for this one's.
        if b"Ready to accept connections" not in log_path.read_bytes():
            return False
        if tls is not None:
            return True
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")

    _wait_or_stop(ping, 20, "redis-server", proc)
    if tls is not None:
        return Service(proc, f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={tls.ca}", port, log_path)
    return Service(proc, f"redis://127.0.0.1:{port}/0", port, log_path)


def start_s3(workdir: Path, port: int | None = None) -> Service:
    """A moto S3 server on loopback. On a free port it is tried up to three times: between `free_port`
    and moto's bind another process (a parallel test's service, a client's ephemeral port) may take
    the port, and moto exits (a fresh clone's run lost a fault test's setup so)."""
    if port is not None:
        return _start_s3(workdir, port)
    for attempt in range(3):
        try:
            return _start_s3(workdir, free_port())
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _start_s3(workdir: Path, port: int) -> Service:
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"moto-{port}.log"
    exe = BIN / "moto_server"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=log_file, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        # Bound by this process (werkzeug says so once it listens): another test's moto_server on the same
        # port (both given it by free_port; this one then exits, "Address already in use") answered the
        # check before, and the test lost its S3 when that one stopped (a fresh-clone CI run).
        if f"Running on {url}".encode() not in log_path.read_bytes():
            return False
        with urllib.request.urlopen(url + "/moto-api/", timeout=1) as response:
            return int(response.status) == 200

    _wait_or_stop(up, 30, "moto_server", proc)
    return Service(proc, url, port, log_path)


@dataclass
class Worker:
    proc: Process
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)

    def events(self) -> list[tuple[str, dict[str, str]]]:
        """Every pipe-delimited event the worker has logged so far, parsed with parse_line."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if "|" in line and line.split("|", 1)[0].isupper():
                out.append(parse_line(line))
        return out

    def find(self, event: str, **match: str) -> list[dict[str, str]]:
        return [f for e, f in self.events() if e == event and all(f.get(k) == v for k, v in match.items())]

    def logged(self, event: str, timeout: float = 30, **match: str) -> list[dict[str, str]]:
        """What `find` gives once it gives a line: a job's line is logged after its result can be read
        (the record first, on purpose), so a test that has just read the result may look too soon."""
        if self.proc.poll() is None:  # an ended worker's log is whole: nothing more to wait for
            wait_for(lambda: bool(self.find(event, **match)) or self.proc.poll() is not None, timeout, event)
        return self.find(event, **match)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The worker stopped (SIGSTOP) for the block, and continued whatever happens in it: a test that
        must see work queued before the worker takes any (a state no machine's speed decides)."""
        self.proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.proc.send_signal(signal.SIGCONT)

    @property
    def http_port(self) -> int:
        return int(self.find("MRC_HTTP_LISTENING")[0]["port"])

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return stop(self.proc, sig, timeout=60)


def base_env(redis_url: str, s3_url: str, bucket: str, home: Path, cpu_threads: int = 0) -> dict[str, str]:
    """A process's environment on these services. `cpu_threads`: MRC_CPU_THREADS, when set (tests: 1);
    0 leaves the choice per call to the worker, as an operator runs it (benchmarks, the demo)."""
    env = {k: v for k, v in environ.items() if not k.startswith("MRC_")}
    if cpu_threads:
        env["MRC_CPU_THREADS"] = str(cpu_threads)
    env.update(
        {
            "MRC_REDIS_URL": redis_url,
            "MRC_S3_ENDPOINT_URL": s3_url,
            "MRC_S3_BUCKET": bucket,
            "MRC_MODEL": "tiny",
            "MRC_DEVICE": "cpu",
            "MRC_HOME": str(home),
            "MRC_METRICS_PORT": "0",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def shared_inputs(env: dict[str, str]) -> dict[str, str]:
    """MRC_API_KEY_SOURCES letting every API key name images in the bucket's shared `inputs/` folder,
    where `mrc submit` and `Client.upload_image` (no key) put them: what tests that upload through
    the Python client and submit through mrc-api need. Another key's uploads stay out of reach."""
    return {"MRC_API_KEY_SOURCES": f"*=s3://{env['MRC_S3_BUCKET']}/{env.get('MRC_S3_PREFIX', '')}inputs/"}


@contextlib.contextmanager
def local_stack(prefix: str, bucket: str, home: Path, **settings: str) -> Iterator[dict[str, str]]:
    """A redis-server and a moto S3 server in a fresh folder, their environment (AWS credentials also
    put in this process's environment), all stopped and removed on exit: a benchmark's services."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    redis = start_redis(work / "redis")
    s3 = start_s3(work / "s3")
    try:
        env = {**base_env(redis.url, s3.url, bucket, home), **settings}
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
        yield env
    finally:
        redis.stop()
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)


def settings_from_env(env: dict[str, str]) -> Any:
    """The Settings a process started with `env` would read (for in-process clients in tests)."""
    from shared.settings import Settings

    return Settings(**{k[4:].lower(): v for k, v in env.items() if k.startswith("MRC_")})


@contextlib.contextmanager
def _sigint_held() -> Iterator[list[int]]:
    """SIGINT recorded, not raised, for the block (on the main thread; no other thread gets it): the
    caller raises it once what the block started is in hand."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous)


def start_worker(env: dict[str, str], log_path: Path, *args: str, timeout: float = 180) -> Worker:
    proc: Process | None = None
    try:
        # A Ctrl-C between the child's start and its name being bound would leave it running, in no
        # one's list of things to stop (the demo's Ctrl-C test met it): held until then.
        with _sigint_held() as interrupted, log_path.open("ab") as log_file:
            proc = _forked("mrc-worker", args, env, stdout=str(log_path), stderr="stdout", session=True)
            if proc is None:
                proc = subprocess.Popen(
                    [str(BIN / "mrc-worker"), *args],
                    env=env,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        if interrupted:
            raise KeyboardInterrupt
        wait_for(lambda: "MRC_CONSUMING" in log_path.read_text(errors="replace"), timeout, "mrc-worker", proc)
    except RuntimeError as exc:
        if proc is None:
            raise
        stop(proc, signal.SIGKILL)
        raise RuntimeError(
            f"{exc}\n--- worker log ---\n{log_path.read_text(errors='replace')[-4000:]}"
        ) from None
    except BaseException:  # Ctrl-C while it loads: it is in no one's list of things to stop yet
        if proc is not None:
            stop(proc, signal.SIGKILL)
        raise
    return Worker(proc, log_path, env)


def _forked(program: str, args: Sequence[str], env: dict[str, str], **how: Any) -> Process | None:
    return None if fork is None else fork(program, args, env, argv0=str(BIN / program), **how)


def run_cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    command = [str(BIN / "mrc"), *args]
    with tempfile.TemporaryDirectory(prefix="mrc-cli-") as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        proc = _forked("mrc", args, env, stdout=str(out), stderr=str(err))
        if proc is None:  # no fork server, or an environment it cannot serve
            return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise subprocess.TimeoutExpired(command, timeout, _read(out), _read(err)) from None
        except BaseException:  # a Ctrl-C: subprocess.run's child would not outlive it either
            proc.kill()
            proc.wait(10)
            raise
        return subprocess.CompletedProcess(command, code, _read(out), _read(err))


def start_cli(
    env: dict[str, str], *args: str, stdout: Path | None = None, stderr: Path | None = None
) -> Process:
    """`mrc ARGS` in the background, its output appended to the files given (None: discarded): forked
    where the session has a fork server (a plain `mrc` costs ~1.3 CPU-s of imports), else plain."""
    proc = _forked("mrc", args, env, stdout=None if stdout is None else str(stdout),
                   stderr=None if stderr is None else str(stderr))  # fmt: skip
    if proc is not None:
        return proc
    with contextlib.ExitStack() as files:
        out, err = (
            files.enter_context(path.open("ab")) if path else subprocess.DEVNULL for path in (stdout, stderr)
        )
        return subprocess.Popen([str(BIN / "mrc"), *args], env=env, stdout=out, stderr=err)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""
