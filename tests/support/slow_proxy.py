"""A TCP proxy on loopback that holds every chunk a client sends for a while before passing it on, in
order: a real S3's round trip in front of moto's server, which answers on loopback in a millisecond
and so hides every round trip mrc makes one after another."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

_METHODS = {b"GET", b"HEAD", b"PUT", b"POST", b"DELETE"}


class SlowProxy:
    """`delay_s` added to each request's way in (the answer comes back at once); changeable while it
    runs. Runs its own event loop on a thread."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port, self.delay_s = target_port, delay_s
        self.port = 0
        # each request's first line (method and path), in the order they came: what a client asked for
        self.requests: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slow-proxy", daemon=True)

    def start(self) -> SlowProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()
        # every connection's pipes ended and the loop closed: nothing left for the collector to warn of
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.run_until_complete(server.wait_closed())
        self._loop.close()

    async def _handle(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        try:
            server_in, server_out = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_out.close()
            return
        try:
            await asyncio.gather(
                self._pipe(client_in, server_out, True), self._pipe(server_in, client_out, False)
            )
        finally:  # the proxy stopped under them too
            client_out.close()
            server_out.close()

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, delayed: bool) -> None:
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def forward() -> None:
            while True:
                due, data = await held.get()
                if not data:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                sink.write(data)
                with contextlib.suppress(ConnectionError):
                    await sink.drain()
            with contextlib.suppress(Exception):
                sink.close()

        forwarding = asyncio.create_task(forward())
        with contextlib.suppress(ConnectionError, OSError):
            while data := await source.read(65536):
                if delayed and data[:8].split(b" ", 1)[0] in _METHODS:
                    self.requests.append(data.split(b"\r\n", 1)[0].decode(errors="replace"))
                await held.put((time.monotonic() + (self.delay_s if delayed else 0.0), data))
        await held.put((0.0, b""))
        await forwarding
