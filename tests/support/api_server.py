"""mrc-api's app served over real HTTP by uvicorn on a thread of the test process (what clients that
bring their own HTTP stack, like the `openai` SDK, need), on a free loopback port."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from producer.server import create_app
from scripts import devservices as services


@contextlib.contextmanager
def serve(env: dict[str, str]) -> Iterator[str]:
    """The API's base URL (`http://127.0.0.1:PORT`) while it serves; stopped on exit."""
    app = create_app(services.settings_from_env(env))
    port = services.free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("mrc-api did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
