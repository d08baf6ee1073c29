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
def api_env(env: dict[str, str], **settings: str) -> Iterator[dict[str, str]]:
    """The session's environment with `settings` for an API in this process, the S3 credentials put in
    this process's environment meanwhile (the in-process API and clients read them from there)."""
    import pytest

    with pytest.MonkeyPatch.context() as patch:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
            patch.setenv(name, env[name])
        yield {**env, **settings}


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
