from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import services


@pytest.fixture(scope="session")
def worker(env: dict[str, str], workdir: Path) -> Iterator[services.Worker]:
    """One real mrc-worker process on the tiny Fuyu (NF4, CPU), shared by the integration tests."""
    w = services.start_worker(env, workdir / "worker.log")
    yield w
    w.stop()


@pytest.fixture
def images_dir(tmp_path: Path) -> Path:
    return tmp_path
