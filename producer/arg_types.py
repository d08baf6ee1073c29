"""argparse types for the numbers `mrc` takes on its command line: a bad one is a usage error (exit 2,
one line from argparse), never a value that fails later in a traceback (review: `--watch -1` printed
once and then raised from time.sleep; `--serve-metrics 99999` an OverflowError; `--timeout -5`
enqueued the job and gave up at once)."""

from __future__ import annotations

import argparse
import math
import re

LONGEST_S = 1e9  # as the settings' own ceiling for seconds


def seconds(value: str) -> float:
    """A positive, finite number of seconds."""
    number = _seconds(value)
    if not 0 < number <= LONGEST_S:
        raise argparse.ArgumentTypeError(
            f"{value[:40]!r}: seconds must be above 0 and at most {LONGEST_S:.0f}"
        )
    return number


def seconds_or_zero(value: str) -> float:
    """A finite number of seconds, 0 included (`--interval 0`: a line at every change)."""
    number = _seconds(value)
    if not 0 <= number <= LONGEST_S:
        raise argparse.ArgumentTypeError(f"{value[:40]!r}: seconds must be from 0 to {LONGEST_S:.0f}")
    return number


def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value[:40]!r} is not a number of seconds") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{value[:40]!r} is not a finite number of seconds")
    return number


def port(value: str) -> int:
    """A TCP port to listen on: 1-65535."""
    if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"{value[:40]!r} is not a port from 1 to 65535")
    return int(value)


def count(value: str) -> int:
    """A positive whole number (at most a signed 32-bit integer)."""
    if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= 2**31 - 1:
        raise argparse.ArgumentTypeError(f"{value[:40]!r} is not a whole number from 1 to {2**31 - 1}")
    return int(value)


def integer(value: str) -> int:
    """A whole number in decimal digits, an optional minus first (its range is checked with the rest
    of the job): `1_0`, ` 5` and `５` are refused, which int() takes (review, helper-84)."""
    if not re.fullmatch(r"-?[0-9]{1,18}", value):
        raise argparse.ArgumentTypeError(f"{value[:40]!r} is not a whole number")
    return int(value)
