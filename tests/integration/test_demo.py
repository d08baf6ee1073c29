"""`make demo` must leave nothing running, also when interrupted with Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.devservices import ROOT

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has exited; only its entry waits to be reaped


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes whose parent is `pid`."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
            command = (status.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        if fields.get("PPid", "").strip() == str(pid) and _alive(int(status.parent.name)):
            found.append((int(status.parent.name), command))
    return found


def test_ctrl_c_while_the_worker_loads_stops_everything_the_demo_started(tmp_path: Path) -> None:
    """The moment a newcomer is most likely to press Ctrl-C: Redis and S3 are up and the worker is
    still loading the model (no list of started services holds it yet)."""
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        # A terminal's Ctrl-C signals the whole foreground process group: do the same.
        demo = subprocess.Popen(
            [sys.executable, str(ROOT / "scripts" / "demo.py")],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    children: list[tuple[int, str]] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and demo.poll() is None:
        children = _children(demo.pid)
        if any("mrc-worker" in command for _pid, command in children):
            break
        time.sleep(0.05)
    commands = " ".join(command for _pid, command in children)
    assert "redis-server" in commands, log.read_text(errors="replace")[-3000:]
    assert "moto_server" in commands
    assert "mrc-worker" in commands
    assert "worker ready" not in log.read_text(errors="replace"), "the worker was up before the Ctrl-C"
    os.killpg(demo.pid, signal.SIGINT)
    assert demo.wait(90) == 130, log.read_text(errors="replace")[-3000:]
    # At once: the demo waits for what it stops (a process that ends later by itself, say a worker
    # that finds Redis gone, was left running)
    assert [command for pid, command in children if _alive(pid)] == []
    assert "interrupted" in log.read_text(errors="replace")
