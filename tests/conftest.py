"""Session-wide real services for integration and fault tests, started on free loopback ports."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts import devservices as services

# The tiny Fuyu is built once per checkout and reused: building it is deterministic (seeded).
MODEL_HOME = services.ROOT / ".cache" / "mrc"
# One OpenMP thread per model call (MRC_CPU_THREADS) in every worker the tests start: the session runs
# several torch processes at once on two cores (xdist's workers, the workers they start), where a call
# on every core spins against its neighbours (~7x slower beside two busy processes: workers/
# cpu_threads.py, docs/benchmarks.md); one thread is each process's fair share. No test is about the
# count; benchmarks and the demo keep the choice per call.
TEST_CPU_THREADS = 1
os.environ.setdefault("MRC_CPU_THREADS", str(TEST_CPU_THREADS))  # the engines tests run in-process


_MARK_BY_FOLDER = {"unit": "unit", "integration": "integration", "faults": "faults", "gpu": "gpu"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test is marked by its folder (`-m unit`, `-m "not faults"`), whatever its module says."""
    for item in items:
        folder = item.path.parent.name
        if folder in _MARK_BY_FOLDER:
            item.add_marker(_MARK_BY_FOLDER[folder])


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("services")


@pytest.fixture(scope="session")
def redis_service(workdir: Path) -> Iterator[services.Service]:
    service = services.start_redis(workdir / "redis")
    yield service
    service.stop()


@pytest.fixture(scope="session")
def s3_service(workdir: Path) -> Iterator[services.Service]:
    service = services.start_s3(workdir / "s3")
    yield service
    service.stop()


@pytest.fixture(scope="session")
def env(redis_service: services.Service, s3_service: services.Service) -> dict[str, str]:
    bucket = f"mrc-test-{uuid.uuid4().hex[:8]}"
    return services.base_env(redis_service.url, s3_service.url, bucket, MODEL_HOME, TEST_CPU_THREADS)
