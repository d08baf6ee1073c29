"""`make demo` must leave nothing running, also when interrupted with Ctrl-C."""

from __future__ import annotations

import os
import re
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


def test_ctrl_c_stops_everything_the_demo_started(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        # A terminal's Ctrl-C signals the whole foreground process group: do the same.
        demo = subprocess.Popen(
            [sys.executable, str(ROOT / "scripts" / "demo.py")],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    pids: list[int] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and demo.poll() is None:
        found = re.search(r"pids ([\d ]+)\)", log.read_text(errors="replace"))
        if found:
            pids = [int(p) for p in found.group(1).split()]
            break
        time.sleep(0.2)
    assert len(pids) == 3, log.read_text(errors="replace")[-3000:]
    os.killpg(demo.pid, signal.SIGINT)
    assert demo.wait(90) == 130
    time.sleep(0.5)
    assert [pid for pid in pids if _alive(pid)] == []
    assert "interrupted" in log.read_text(errors="replace")
