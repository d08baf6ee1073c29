"""Progress of a backlog run on stderr: a live display on a terminal, a plain line every few seconds
otherwise (cron logs keep one readable line per interval, no control characters)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def describe(data: dict[str, Any]) -> str:
    """One line from an enqueue snapshot or a run status."""
    if "enqueued" in data:  # enqueuing
        parts = [
            f"lines {data['lines']}",
            f"enqueued {data['enqueued']}",
            f"already there {data['already']}",
            f"invalid {data['invalid']}",
            f"uploaded {data['uploaded']}",
            f"{data['lines_per_s']} lines/s",
        ]
        if data.get("waiting_for_room"):
            why = data.get("waiting_why") or "at its depth limit"
            parts.append(f"waiting for room on the backlog lane ({why})")
        return "enqueue: " + ", ".join(parts)
    failed = data.get("failed_by_code") or {}
    codes = f" ({', '.join(f'{k} {v}' for k, v in sorted(failed.items()))})" if failed else ""
    return (
        f"run {data['run_id']}{_state(data.get('state'))}: {data['succeeded']}/{data['jobs']} done, "
        f"{data['failed']} failed{codes}, "
        f"{data['queued']} queued"
        + (f" ({data['cancelling']} of them cancelled, to end so)" if data.get("cancelling") else "")
        + f", {data['running']} running, {data['invalid_lines']} invalid lines, "
        + _unknown(data)
        + f"{data['rate_per_s']}/s, ETA {_eta(data.get('eta_s'))}{_tokens(data.get('usage'))}"
    )


def _state(state: str | None) -> str:
    """What the counts are of: a run whose lines are not all queued yet (review, helper-76: "90/90
    done" for a 300-line run whose pass was killed), or one cancelled, failed (a batch), lost or
    expired."""
    if state == "enqueuing":
        return " (enqueuing: not every line is queued yet, or its pass stopped: --resume)"
    return f" ({state})" if state in ("cancelled", "failed", "lost", "expired") else ""


def _unknown(data: dict[str, Any]) -> str:
    """Jobs without a record: expired (after 7 days), or lost with Redis's data in a younger run."""
    if data.get("lost"):
        return (
            f"{data['lost']} without a record (lost with Redis's data: a pass of the run, `--resume` or "
            "its manifest again with --run-id, queues again those without a result), "
        )
    return (
        f"{data['unknown']} unknown (records expired, or lost by Redis: the report reads the results), "
        if data.get("unknown")
        else ""
    )


def _tokens(usage: dict[str, int] | None) -> str:
    if not usage:
        return ""
    return f", tokens {usage.get('prompt_tokens', 0)} in / {usage.get('completion_tokens', 0)} out"


class Display:
    """Shows snapshots as they come: live (rich) when `stream` is a terminal, else at most one line
    per `interval_s` (the first at once, the last one on close)."""

    def __init__(
        self,
        stream: TextIO | None = None,
        interval_s: float = 10.0,
        live: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.live = self.stream.isatty() if live is None else live
        self._clock = clock
        self._last_line = ""
        self._printed = ""
        # None until the first line: a monotonic clock starts near 0 on a machine that just booted, so
        # "0.0" as "never" would hold the first line back for as long as the machine has been up.
        self._printed_at: float | None = None
        self._status: Any = None
        if self.live:
            from rich.console import Console

            self._status = Console(file=self.stream).status("starting")
            self._status.start()

    def show(self, data: dict[str, Any]) -> None:
        line = describe(data)
        self._last_line = line
        if self._status is not None:
            self._status.update(line)
        elif self._printed_at is None or self._clock() - self._printed_at >= self.interval_s:
            self._print(line)

    def close(self) -> None:
        """Stop the status line and print the last progress line (once: a second close does nothing)."""
        if self._status is not None:
            self._status.stop()
            self._status = None
        if self._last_line and self._last_line != self._printed:
            self._print(self._last_line)

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)
        self._printed, self._printed_at = line, self._clock()
