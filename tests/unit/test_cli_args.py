"""The command lines' numbers and lists are checked by argparse: a bad one is exit 2 with one line,
before anything is enqueued, connected or slept on (review helper-60: `--watch -1` raised from
time.sleep, `--serve-metrics 99999` an OverflowError, `--timeout -5` enqueued the job and gave up at
once, `mrc-worker --lanes bogus` exited 1)."""

from __future__ import annotations

import pytest

from producer import cli


@pytest.mark.parametrize(
    "argv",
    [
        ["queues", "--watch", "-1"],
        ["queues", "--watch", "0"],
        ["queues", "--watch", "nan"],
        ["queues", "--serve-metrics", "-1"],
        ["queues", "--serve-metrics", "99999"],
        ["queues", "--serve-metrics", "0"],
        ["submit", "--image", "x.png", "--prompt", "hi", "--wait", "--timeout", "-5"],
        ["submit", "--image", "x.png", "--prompt", "hi", "--wait", "--timeout", "inf"],
        ["backlog", "manifest.jsonl", "--wait", "--timeout", "0"],
        ["backlog", "manifest.jsonl", "--interval", "-2"],
        ["backlog", "manifest.jsonl", "--interval", "inf"],
        ["backlog", "manifest.jsonl", "--rate", "nan"],
        ["backlog", "manifest.jsonl", "--rate=-nan"],
        ["backlog", "manifest.jsonl", "--rate", "1e-300"],
        ["backlog", "manifest.jsonl", "--rate", "inf"],
        ["backlog", "manifest.jsonl", "--rate", "0"],
        ["dlq", "list", "--limit", "0"],
        ["dlq", "requeue", "--limit", "-3"],
    ],
)
def test_a_bad_number_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli._parser().parse_args(argv)
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert "Traceback" not in said
    assert said.strip().splitlines()[-1].startswith("mrc ")  # argparse's one line, naming the command


def test_good_numbers_are_read() -> None:
    args = cli._parser().parse_args(["queues", "--watch", "0.5", "--serve-metrics", "9401"])
    assert (args.watch, args.serve_metrics) == (0.5, 9401)
    args = cli._parser().parse_args(["submit", "--image", "x", "--prompt", "p", "--timeout", "12"])
    assert args.timeout == 12.0
    assert cli._parser().parse_args(["backlog", "m.jsonl", "--interval", "0"]).interval == 0.0  # every change
    assert cli._parser().parse_args(["backlog", "m.jsonl", "--rate", "500/s"]).rate == 500.0
    assert cli._parser().parse_args(["backlog", "m.jsonl", "--rate", "0.001"]).rate == 0.001


@pytest.mark.parametrize("lanes", ["bogus", "", ",", "interactive,bogus"])
def test_the_worker_refuses_unknown_lanes_as_a_usage_error(lanes: str) -> None:
    from workers import cli as worker_cli

    with pytest.raises(SystemExit) as exited:
        worker_cli._parser().parse_args(["--lanes", lanes])
    assert exited.value.code == 2


def test_the_worker_reads_its_lanes_in_order() -> None:
    from workers import cli as worker_cli

    assert worker_cli._parser().parse_args(["--lanes", " backlog , interactive"]).lanes == [
        "backlog",
        "interactive",
    ]
    assert worker_cli._parser().parse_args([]).lanes == ["interactive", "backlog"]


def test_json_printed_for_a_person_escapes_what_drives_or_reorders_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Review, helper-62: `mrc events` and `mrc dlq list` printed a ticket id's U+202E (the line shown
    backwards), U+2028, U+2029 and NEL raw; readable text stays readable."""
    import json

    value = {
        "ticket_id": "T-1\u202eevil\u2066",
        "prompt": "a\u2028b\u2029c\x85d\x9b31m\x1b[0m",
        "q": "colis abîmé 中",
    }
    cli._print_json(value)
    out = capsys.readouterr().out
    assert json.loads(out) == value
    assert not set(out) & {"\u202e", "\u2066", "\u2028", "\u2029", "\x85", "\x9b", "\x1b"}
    assert "colis abîmé 中" in out
