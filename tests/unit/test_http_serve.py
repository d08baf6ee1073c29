"""The worker's health and metrics port, and the lane exporter's, as anyone on the network may use
them (review, helper-62): clients that reset or leave mid-answer print nothing (a traceback of many
lines broke the one-line log), and half-sent requests hold no thread past a timeout nor more than a
few at once."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import pytest

from shared import http_serve
from workers import health
from workers.metrics import Metrics


def _get(port: int, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return response.status, response.read()


def test_clients_that_reset_or_leave_print_nothing_and_the_port_answers_after(
    capfd: pytest.CaptureFixture[str],
) -> None:
    state = health.HealthState()
    server = health.serve(0, state, Metrics(), host="127.0.0.1")
    port = server.server_address[1]
    try:
        for i in range(30):
            conn = socket.create_connection(("127.0.0.1", port))
            if i % 2:  # reset: the answer's write fails with ECONNRESET or EPIPE
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            else:  # a request cut in its middle
                conn.sendall(b"GET /metrics HTTP/1.1\r\nHo")
            conn.close()
        status, body = _get(port, "/metrics")
        assert status == 200
        assert b"mrc_jobs_total" in body
        time.sleep(0.5)  # the handlers of the last few have finished
    finally:
        server.shutdown()
        server.server_close()
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err, captured.err[:2000]
    assert "Exception occurred" not in captured.err, captured.err[:2000]


def _threads_settle(started: int, extra: int) -> bool:
    """Whether this process's threads come down to `extra` more than `started` (a connection cut
    ends its thread at its next read, a moment later)."""
    deadline = time.monotonic() + 10
    while threading.active_count() - started > extra and time.monotonic() < deadline:
        time.sleep(0.05)
    return threading.active_count() - started <= extra


def test_idle_or_trickling_connections_never_keep_a_probe_from_its_answer() -> None:
    """At most `max_connections` held at once, and a new one closes the oldest: neither half-sent nor
    trickling requests (a byte now and then, each read within the timeout) keep a probe from its
    answer (review, helper-65: 16 such connections made /healthz fail, and kubelet restarts the
    worker on that), and the threads stay bounded."""
    started = threading.active_count()
    routes: dict[str, http_serve.Route] = {"/healthz": lambda: (200, b"ok", "text/plain")}
    server = http_serve.serve("127.0.0.1", 0, routes, "test-bounded", max_connections=3, timeout_s=30.0)
    port = server.server_address[1]
    held: list[socket.socket] = []
    try:
        for _ in range(12):
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"GET /healthz HTTP/1.1\r\n")  # never finished
            conn.settimeout(10)
            held.append(conn)
        # the oldest were closed unanswered as newer ones came; the 3 newest are held
        assert [conn.recv(1) for conn in held[:9]] == [b""] * 9
        assert _threads_settle(started, 4)  # the serving thread and 3 handlers (the cut ones end)
        for _ in range(3):  # the held ones trickle on, and a probe is answered each time
            for conn in held[9:]:
                with contextlib.suppress(OSError):
                    conn.sendall(b"X")
            assert _get(port, "/healthz") == (200, b"ok")
        assert _threads_settle(started, 4)
        with pytest.raises(urllib.error.HTTPError) as missing:
            _get(port, "/nowhere")
        assert missing.value.code == 404
        missing.value.close()
        head = urllib.request.Request(f"http://127.0.0.1:{port}/healthz", method="HEAD")
        with urllib.request.urlopen(head, timeout=10) as response:
            assert (response.status, response.read()) == (200, b"")
    finally:
        for conn in held:
            conn.close()
        server.shutdown()
        server.server_close()
