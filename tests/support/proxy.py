"""A TCP proxy on loopback that can be cut and restored: an S3 outage without losing S3's data."""

from __future__ import annotations

import contextlib
import socket
import threading


class Proxy:
    def __init__(self, target_port: int, port: int) -> None:
        self.target_port = target_port
        self.port = port
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._hanging = False
        self._held: list[socket.socket] = []
        self._reserved: socket.socket | None = None  # the port, held while stopped

    def hang(self) -> None:
        """Accept connections and never answer (a wedged endpoint): requests wait for their timeout."""
        self._hanging = True
        self._cut()

    def unhang(self) -> None:
        """Forward again; the connections held while hanging are cut, so their requests fail now."""
        self._hanging = False
        with self._lock:
            held, self._held = self._held, []
        _close(held)

    def start(self) -> None:
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def stop(self) -> None:
        """Refuse new connections and cut the open ones, as a dead endpoint would."""
        server, self._server = self._server, None
        if server is not None:
            # close() alone leaves the accept() blocked in the other thread holding the listening
            # socket open (Linux), and new connections kept being accepted: shutdown wakes it.
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()
        self._cut()
        self._reserve()

    def close(self) -> None:
        """Stopped for good: the port let go too."""
        self.stop()
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None

    def _reserve(self) -> None:
        """Keep the port bound, not listening, while stopped: a connection is still refused, as by a
        dead endpoint, and no other test's server is handed the port meanwhile (one was: a moto server
        of another test answered this proxy's S3 requests with 404, and its worker took it for a
        broken store)."""
        reserved = socket.socket()
        try:
            reserved.bind(("127.0.0.1", self.port))
        except OSError:  # the stopped listener's connections linger in TIME_WAIT
            reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                reserved.bind(("127.0.0.1", self.port))
            except OSError:
                reserved.close()
                return
        self._reserved = reserved

    def _cut(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        _close(conns)

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            if self._hanging:
                with self._lock:
                    self._held.append(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def _close(conns: list[socket.socket]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()
