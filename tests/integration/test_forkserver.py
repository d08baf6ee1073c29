"""The test session's fork server (tests/support/forkserver.py) starts processes a test cannot tell
from plain ones: the same exit code, output and error for the same command, the environment asked
for and nothing of the server's, signals as a plain process takes them, its own session when asked.
Every test of the suite that starts `mrc` or `mrc-worker` leans on this."""

from __future__ import annotations

import http.server
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from scripts import devservices as services

pytestmark = pytest.mark.integration

_TIME = re.compile(r"ts=[^|\n]*")


@pytest.fixture
def servers() -> object:
    if services.fork is None:
        pytest.skip("the session runs without a fork server (TEST_FORKSERVER=0, or a CUDA device)")
    return services.fork


def _seen(done: subprocess.CompletedProcess[str]) -> tuple[int, str, str]:
    return done.returncode, _TIME.sub("ts=", done.stdout), _TIME.sub("ts=", done.stderr)


def test_a_forked_command_answers_as_a_plain_one(
    env: dict[str, str], servers: object, tmp_path: Path
) -> None:
    commands = [
        (env, ("--help",)),
        (env, ("submit", "--image", str(tmp_path / "missing.png"), "--prompt", "is it damaged?")),
        (env, ("status", "no-such-job")),
        (env, ("backlog", "status", "no-such-run")),
        ({**env, "MRC_REDIS_URL": "http://not-redis"}, ("queues",)),  # a setting refused
        ({**env, "MRC_NO_SUCH_SETTING": "1"}, ("status", "no-such-job")),  # warned about, by name
    ]
    forked = [_seen(services.run_cli(e, *args)) for e, args in commands]
    saved, services.fork = services.fork, None
    try:
        unforked = [_seen(services.run_cli(e, *args)) for e, args in commands]
    finally:
        services.fork = saved
    for (_env, args), one, other in zip(commands, forked, unforked, strict=True):
        assert one == other, args
    assert {code for code, _, _ in forked} != {0}  # the commands above include refusals


def _follow(env: dict[str, str], tmp_path: Path, name: str) -> services.Process:
    assert services.fork is not None
    proc = services.fork(
        "mrc", ["events", "--follow"], env, argv0=str(services.BIN / "mrc"),
        stdout=str(tmp_path / f"{name}.out"), stderr=str(tmp_path / f"{name}.err"), session=True,
    )  # fmt: skip
    assert proc is not None
    return proc


def test_a_forked_process_has_its_own_session_folder_and_signals(
    env: dict[str, str], servers: object, tmp_path: Path
) -> None:
    # (The environment asked for is checked by what the commands above did with it: /proc's environ
    # shows a forked process's first environment, the server's, whatever it holds now.)
    proc = _follow(env, tmp_path, "a")
    time.sleep(1.0)  # into its long poll
    assert proc.poll() is None
    assert os.getpgid(proc.pid) == proc.pid  # a session (and process group) of its own
    assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "mrc"  # what pgrep and ps see
    assert os.readlink(f"/proc/{proc.pid}/cwd") == os.getcwd()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130  # mrc's Ctrl-C exit code, as a plain process gives it
    killed = _follow(env, tmp_path, "b")
    killed.kill()
    assert killed.wait(30) == -signal.SIGKILL
    # A client gone before its request (a test interrupted) costs the server nothing.
    stray = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stray.connect(servers.servers["light"].path)  # type: ignore[attr-defined]
    stray.close()
    waited = _follow(env, tmp_path, "c")
    with pytest.raises(subprocess.TimeoutExpired):
        waited.wait(0.5)
    waited.kill()
    assert waited.wait(30) == -signal.SIGKILL


def test_an_environment_read_at_import_time_gets_a_plain_process(
    env: dict[str, str], servers: object
) -> None:
    # OMP_NUM_THREADS is read when OpenMP loads: the server's value would be the test's otherwise.
    assert services.fork is not None
    omp = {**env, "OMP_NUM_THREADS": "3"}
    assert services.fork("mrc", ["--help"], omp, argv0="mrc", stdout=None, stderr=None) is None
    done = services.run_cli({**env, "OMP_NUM_THREADS": "3"}, "--help")
    assert done.returncode == 0
    assert "submit" in done.stdout


def test_a_forked_command_signs_s3_requests_with_its_own_keys_and_region(
    env: dict[str, str], servers: object
) -> None:
    """The server holds boto3's default session with S3's model loaded (tests/support/forkserver.py,
    _warm_boto3): a child's requests are still signed with the keys and region of its own
    environment, as a plain process's are."""
    seen: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET = do_PUT = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for forked in (True, False):
            child = {
                **env,
                "MRC_S3_ENDPOINT_URL": f"http://127.0.0.1:{server.server_address[1]}",
                "AWS_ACCESS_KEY_ID": f"child-key-{forked}",
                "AWS_SECRET_ACCESS_KEY": "child-secret",
                "AWS_DEFAULT_REGION": "eu-west-3",
                "MRC_S3_REGION": "eu-west-3",
            }
            saved = services.fork
            services.fork = saved if forked else None
            try:
                seen.clear()
                done = services.run_cli(child, "result", "no-such-job")
            finally:
                services.fork = saved
            assert done.returncode != 0  # the recorder refuses every request
            assert seen, done.stderr
            assert all(f"Credential=child-key-{forked}/" in header for header in seen), seen
            assert all("/eu-west-3/s3/aws4_request" in header for header in seen), seen
    finally:
        server.shutdown()
        server.server_close()


def test_commands_asked_for_at_once_from_threads_are_all_forked_by_one_server(
    env: dict[str, str], servers: object, tmp_path: Path
) -> None:
    """The parcels test starts two workers from two threads: both started the model server on one
    socket, the second could not bind, and every model worker of the session after it was a plain
    process. Here a fresh set of servers is asked for two commands at once, before any server runs."""
    from tests.support import forkserver

    fresh = forkserver.ForkServers(env, tmp_path / "forkserver.log")
    gate = threading.Barrier(3)
    procs: list[services.Process | None] = []

    def ask(name: str) -> None:
        gate.wait(10)
        procs.append(
            fresh(
                "mrc",
                ["--help"],
                env,
                argv0=str(services.BIN / "mrc"),
                stdout=str(tmp_path / name),
                stderr=None,
            )
        )

    threads = [threading.Thread(target=ask, args=(f"out-{n}",)) for n in range(3)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert len(procs) == 3
        assert all(proc is not None for proc in procs), (tmp_path / "forkserver.log").read_text()
        assert [proc.wait(60) for proc in procs if proc is not None] == [0, 0, 0]
        assert list(fresh.servers) == ["light"]
        assert not fresh.broken
    finally:
        fresh.close()
