from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from producer.client import Client
from scripts import devservices as services


@pytest.fixture(scope="session")
def worker(env: dict[str, str], workdir: Path) -> Iterator[services.Worker]:
    """One real mrc-worker process on the tiny Fuyu (NF4, CPU), shared by the integration tests."""
    w = services.start_worker(env, workdir / "worker.log")
    yield w
    w.stop()


@pytest.fixture
def images_dir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def client(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Client:
    """An in-process producer client on the session's Redis and S3."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, env[name])
    return Client(services.settings_from_env(env))
