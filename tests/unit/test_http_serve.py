"""The worker's health and metrics port, and the lane exporter's, as anyone on the network may use
them (review, helper-62): clients that reset or leave mid-answer print nothing (a traceback of many
lines broke the one-line log), and half-sent requests hold no thread past a timeout nor more than a
few at once."""

from __future__ import annotations

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


def test_half_sent_requests_hold_at_most_the_cap_and_only_until_the_timeout() -> None:
    started = threading.active_count()
    routes: dict[str, http_serve.Route] = {"/metrics": lambda: (200, b"ok", "text/plain")}
    server = http_serve.serve("127.0.0.1", 0, routes, "test-bounded", max_connections=3, timeout_s=4.0)
    port = server.server_address[1]
    held: list[socket.socket] = []
    try:
        for _ in range(12):
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"GET /metrics HTTP/1.1\r\n")  # never finished
            conn.settimeout(10)
            held.append(conn)
        # past the cap a connection is closed unanswered, at once
        assert [conn.recv(1) for conn in held[3:]] == [b""] * 9
        # the serving thread and the 3 handlers, not one thread per connection
        assert threading.active_count() - started <= 4
        # the three served are let go at their timeout (closed), and the port answers again
        assert [conn.recv(1) for conn in held[:3]] == [b""] * 3
        assert _get(port, "/metrics") == (200, b"ok")
        with pytest.raises(urllib.error.HTTPError) as missing:
            _get(port, "/nowhere")
        assert missing.value.code == 404
        missing.value.close()
    finally:
        for conn in held:
            conn.close()
        server.shutdown()
        server.server_close()
