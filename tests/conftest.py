"""Session-wide real services for integration and fault tests, started on free loopback ports."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts import devservices as services
from tests.support import forkserver

# The tiny Fuyu is built once per checkout and reused: building it is deterministic (seeded).
MODEL_HOME = services.ROOT / ".cache" / "mrc"
# One OpenMP thread per model call (MRC_CPU_THREADS) in every worker the tests start: the session runs
# several torch processes at once on two cores (xdist's workers, the workers they start), where a call
# on every core spins against its neighbours (~7x slower beside two busy processes: workers/
# cpu_threads.py, docs/benchmarks.md); one thread is each process's fair share. No test is about the
# count; benchmarks and the demo keep the choice per call.
TEST_CPU_THREADS = 1
os.environ.setdefault("MRC_CPU_THREADS", str(TEST_CPU_THREADS))  # the engines tests run in-process
# The processes tests start get the environment the session began with (scripts/devservices.py), not
# what the tests' own imports of torch and the worker's modules added to this process's.
services.environ = dict(os.environ)


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


@pytest.fixture(scope="session", autouse=True)
def fork_servers(workdir: Path) -> Iterator[None]:
    """`mrc` and `mrc-worker` forked from servers that imported them once (tests/support/forkserver.py:
    most of the suite's CPU was their imports), each started at its first use. Not beside a CUDA
    device (a forked process cannot use CUDA its parent touched), nor with TEST_FORKSERVER=0."""
    if os.environ.get("TEST_FORKSERVER") == "0" or Path("/dev/nvidiactl").exists():
        yield
        return
    # The environment base_env gives every process the tests start, less what a process reads per call.
    like = services.base_env("redis://127.0.0.1:1", "http://127.0.0.1:1", "unused", MODEL_HOME)
    servers = forkserver.ForkServers(like, workdir / "forkserver.log")
    services.fork = servers
    try:
        yield
    finally:
        services.fork = None
        servers.close()


@pytest.fixture(scope="session")
def env(redis_service: services.Service, s3_service: services.Service) -> dict[str, str]:
    bucket = f"mrc-test-{uuid.uuid4().hex[:8]}"
    return services.base_env(redis_service.url, s3_service.url, bucket, MODEL_HOME, TEST_CPU_THREADS)
