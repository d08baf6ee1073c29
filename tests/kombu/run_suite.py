"""kombu's own Redis transport tests, run against mrc's transport (shared/transport.py).

Downloads the released source of the installed kombu version (its tests are in the sdist, never
copied into this repository), runs its Redis unit tests (fake client) and integration tests (against
a redis-server started here) with mrc's Channel and Transport swapped in, and compares the failures
with `expected_differences.txt`: each line a test id pattern and the reason mrc differs on purpose.
Any other failure fails; so does an expected difference that no longer happens (the list stays true).
Upgrading kombu then says at once what the override broke.

    python tests/kombu/run_suite.py            # `make test-kombu`; `make test` runs it too
Exit 0 when the outcomes match the list (or the package registry cannot be reached: then it says it
skipped), 1 otherwise.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import os
import signal
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from scripts import devservices  # noqa: E402 - after the path is set

SUITES = [
    "t/unit/transport/test_redis.py",
    "t/integration/test_redis.py",
    "t/integration/test_redis_brpop_qos.py",
]
# Run at once, one process and one redis-server each (the unit tests patch kombu's poller module-wide;
# the integration tests mostly wait on timers, so side by side they cost no more CPU and a quarter of
# the time). The integration suite is cut by keyword into parts that together hold every test: its
# `global_keyprefix` variants (parameter id `connection1`), and the rest in three groups of classes.
_SLOW = "QueueExpiration", "BrpopHealthCheck or BaseExchangeTypes or Sentinel or Restore"
PARTS = [
    (SUITES[0], None),
    (SUITES[1], "connection1"),
    (SUITES[1], f"({_SLOW[0]}) and not connection1"),
    (SUITES[1], f"({_SLOW[1]}) and not connection1"),
    (SUITES[1], f"not ({_SLOW[0]} or {_SLOW[1]}) and not connection1"),
    (SUITES[2], None),
]


def _source(version: str) -> Path | None:
    """kombu's released source tree for `version`, downloaded once into .cache/; None when offline."""
    cache = ROOT / ".cache" / "kombu"
    tree = cache / f"kombu-{version}"
    if (tree / "t").is_dir():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    fetched = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
         f"kombu=={version}", "-d", str(cache)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    archive = cache / f"kombu-{version}.tar.gz"
    if fetched.returncode != 0 or not archive.is_file():
        why = fetched.stderr.strip()[-200:]
        print(f"test-kombu: skipped: cannot download kombu=={version}'s source ({why})")
        return None
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    return tree


def _expected() -> list[tuple[str, str]]:
    rows = []
    for line in (HERE / "expected_differences.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pattern, _, reason = line.partition(" | ")
            rows.append((pattern.strip(), reason.strip()))
    return rows


def _outcomes(report: Path) -> dict[str, bool]:
    """test id -> passed, from pytest's JUnit XML (skipped tests left out)."""
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        if any(child.tag == "skipped" for child in case):
            continue
        test_id = _test_id(case.get("classname", ""), case.get("name", ""))
        outcomes[test_id] = not any(child.tag in ("failure", "error") for child in case)
    return outcomes


def _test_id(classname: str, name: str) -> str:
    """`t.integration.test_redis.test_RedisMessage`, `test_ack[x]` -> the pytest node id."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        candidate = "/".join(parts[:i]) + ".py"
        if candidate in SUITES:
            return "::".join([candidate, *parts[i:], name])
    return f"{classname}::{name}"


def _stopped(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    # `make test` runs this in the background beside pytest, where the shell has it ignore Ctrl-C:
    # heard again (SIGTERM as Ctrl-C), so a stopped make stops it, its pytests and its redis-servers
    # (review: they ran on, orphaned, into the next make test's folders).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _stopped)
    version = importlib.metadata.version("kombu")
    tree = _source(version)
    if tree is None:
        return 0
    work = ROOT / ".cache" / "kombu" / "run"
    outcomes: dict[str, bool] = {}
    running: list[tuple[subprocess.Popen[bytes], Path, devservices.Service]] = []
    try:
        for n, (suite, keyword) in enumerate(PARTS):
            redis = devservices.start_redis(work / f"redis-{n}")
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
                "REDIS_HOST": "127.0.0.1",
                "REDIS_6379_TCP": str(redis.port),
            }
            report = work / f"{suite.replace('/', '_')}-{n}.xml"
            report.unlink(missing_ok=True)
            args = [sys.executable, "-m", "pytest", suite, "-p", "mrc_kombu_swap", "-q",
                    "-p", "no:cacheprovider", "-W", "ignore", "-o", "addopts=", f"--junitxml={report}",
                    "--timeout=120"]  # fmt: skip
            if keyword:
                args += ["-k", keyword]
            proc = subprocess.Popen(
                args, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            running.append((proc, report, redis))
        for proc, report, _redis in running:
            proc.wait(1200)
            outcomes.update(_outcomes(report))
    finally:
        for proc, _report, redis in running:
            if proc.poll() is None:
                proc.kill()
            redis.stop()
    return _compare(version, outcomes, _expected())


def _compare(version: str, outcomes: dict[str, bool], expected: list[tuple[str, str]]) -> int:
    failed = sorted(test_id for test_id, passed in outcomes.items() if not passed)
    unexpected = [t for t in failed if not any(fnmatch.fnmatchcase(t, p) for p, _ in expected)]
    stale = [
        (p, reason) for p, reason in expected
        if not any(fnmatch.fnmatchcase(t, p) for t in failed)
    ]  # fmt: skip
    print(
        f"test-kombu: kombu {version}: {len(outcomes)} tests, {len(outcomes) - len(failed)} passed, "
        f"{len(failed) - len(unexpected)} expected differences, {len(unexpected)} unexpected failures, "
        f"{len(stale)} expected differences that no longer happen"
    )
    for test_id in unexpected:
        print(f"  UNEXPECTED FAILURE {test_id}")
    for pattern, reason in stale:
        print(f"  NO LONGER DIFFERS  {pattern}  ({reason}): update tests/kombu/expected_differences.txt")
    print(f"kombu: {len(outcomes) - len(failed)} passed, {len(unexpected) + len(stale)} failed")
    return 1 if unexpected or stale or not outcomes else 0


if __name__ == "__main__":
    sys.exit(main())
