"""A batch's output and error files, written once every request has ended (or, after a cancel or
the window's end, every one that was running): every non-blank input line ends in exactly one of
them, in input order. The output file holds the requests answered 200 (`response.body` = the
chat.completion); the error file the rest, each with what `POST /v1/chat/completions` would have
answered (`response.status_code`, `response.body` = the error), or, for a request the batch never
ran, `response: null` and `error.code` `batch_cancelled` / `batch_expired`. Writing again (after the
writer's process died) writes the same files under the same ids.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from producer.backlog import manifest
from producer.backlog.run import Backlog
from producer.openai.batch_book import FINAL, BatchBook, now
from producer.openai.batch_lines import custom_id_of
from producer.openai.completion import completion
from producer.openai.files import Files, new_file_id
from shared import encoding, logs, names, tenants
from shared import usage as usage_book
from shared.records import unstored_result

_GROUP = 500
_READ_THREADS = 16
_ENDED = {"cancelled": "batch_cancelled", "expired": "batch_expired"}
InputLines = Callable[[str], Iterator[tuple[int, bytes]]]


class Output:
    def __init__(self, backlog: Backlog, book: BatchBook, files: Files, input_lines: InputLines) -> None:
        self.backlog, self.book, self.files, self._input = backlog, book, files, input_lines
        self.queue, self.settings = backlog.queue, backlog.settings
        self.log = logs.get_logger()

    def write(self, batch_id: str, renew: Callable[[], None]) -> None:
        record = self.book.get(batch_id)
        if record.get("status") in FINAL:
            return
        began = time.monotonic()
        ended_by = record.get("ended_by", "")
        counts: Counter[str] = Counter()
        usage = usage_book.empty_sums()
        sizes = {"output": 0, "errors": 0}
        models: list[str] = []
        with tempfile.SpooledTemporaryFile(8 << 20, mode="w+", encoding="utf-8") as errors:

            def output_lines() -> Iterator[str]:
                for kind, line, result in self._outcomes(batch_id, ended_by, renew):
                    text = encoding.to_text(line) + "\n"  # writable whatever the line carried
                    counts[kind] += 1
                    counts["jobs"] += 1 if (line.get("response") or {}).get("request_id") else 0
                    sizes[kind] += len(text.encode())
                    if result is not None:
                        _add_usage(usage, result)
                        models[:] = models or [str((result.get("model") or {}).get("id") or "")]
                    if kind == "output":
                        yield text
                    else:
                        errors.write(text)

            output_key = self._key(batch_id, "openai_output.jsonl")
            errors_key = self._key(batch_id, "openai_errors.jsonl")
            self.backlog.files.write_lines(output_key, output_lines())
            errors.seek(0)
            self.backlog.files.write_lines(errors_key, errors)
        done = self._describe(batch_id, record["owner"], counts, sizes, (output_key, errors_key))
        final = {"cancelled": "cancelled", "expired": "expired"}.get(ended_by) or (
            "completed" if counts["jobs"] else self._all_refused(batch_id)
        )
        result_counts = {
            "total": counts["output"] + counts["errors"],
            "completed": counts["output"],
            "failed": counts["errors"],
        }
        self.book.update(
            batch_id,
            **done,
            status=final,
            **{f"{final}_at": now()},
            request_counts=json.dumps(result_counts),
            usage=json.dumps(usage),
            model=models[0] if models else "",
        )
        self.book.settle(batch_id)
        drop_input_copy(self.backlog, self._key(batch_id, "input.jsonl"))
        self.log.info(
            "MRC_BATCH_DONE",
            batch_id=batch_id,
            status=final,
            completed=counts["output"],
            failed=counts["errors"],
            seconds=round(time.monotonic() - began, 3),
        )

    def _describe(
        self, batch_id: str, owner: str, counts: Counter[str], sizes: dict[str, int], keys: tuple[str, str]
    ) -> dict[str, str]:
        """The output and error files as the owner's files (none for an empty one); their ids are
        chosen once per batch, so writing again describes the same files."""
        done = {"output_file_id": "", "error_file_id": ""}
        for kind, key, name in (("output", keys[0], "output"), ("errors", keys[1], "error")):
            if counts[kind]:
                file_id = self.book.set_if_absent(batch_id, f"{name}_file_planned", new_file_id())
                self.files.add_output(owner, file_id, key, sizes[kind], f"{batch_id}_{name}.jsonl")
                done[f"{name}_file_id"] = file_id
        return done

    def _all_refused(self, batch_id: str) -> str:
        errors = {
            "object": "list",
            "data": [
                {
                    "code": "no_valid_requests",
                    "line": None,
                    "param": None,
                    "message": "no line of the input file is a request mrc runs; the error file says why",
                }
            ],
        }
        self.book.update(batch_id, errors=json.dumps(errors))
        return "failed"

    def _outcomes(
        self, batch_id: str, ended_by: str, renew: Callable[[], None]
    ) -> Iterator[tuple[str, dict[str, Any], dict[str, Any] | None]]:
        """(output | errors, the file's line, the job's result) for every non-blank input line, in order."""
        lines = ((n, raw) for n, raw in self._input(batch_id) if raw.strip())
        entries = iter(self.backlog.entries(batch_id))
        entry = next(entries, None)
        with ThreadPoolExecutor(_READ_THREADS) as pool:
            for group in manifest.batched(lines, _GROUP):
                renew()
                items = []
                for number, raw in group:
                    while entry is not None and int(entry["line"]) < number:
                        entry = next(entries, None)
                    items.append(
                        (number, raw, entry if entry is not None and entry["line"] == number else None)
                    )
                for (number, raw, mine), result in zip(items, pool.map(self._result_of, items), strict=True):
                    yield (*_line(batch_id, number, raw, mine, result, ended_by), result)

    def _result_of(self, item: tuple[int, bytes, dict[str, Any] | None]) -> dict[str, Any] | None:
        entry = item[2]
        if entry is None or "job_id" not in entry:
            return None
        job_id = str(entry["job_id"])
        result = self.queue.result(job_id)
        if result is None:  # ended without a stored result: its record says how
            record = self.queue.records.get(job_id)
            if record.get("state") == "failed" and record.get("error_code"):
                return unstored_result(job_id, record)
        return result

    def _key(self, batch_id: str, name: str) -> str:
        return names.run_key(self.settings.s3_prefix, batch_id, name)


def _add_usage(sums: dict[str, int], result: dict[str, Any]) -> None:
    used = result.get("usage") or {}
    row = [
        str(used.get("prompt_tokens", 0)),
        str(used.get("image_tokens", 0)),
        str(used.get("completion_tokens", 0)),
        "1" if result.get("cache_hit") else "0",
        str(used.get("cached_tokens", 0)),
    ]
    usage_book.add_records(sums, [list(row)])


def _line(
    batch_id: str,
    number: int,
    raw: bytes,
    entry: dict[str, Any] | None,
    result: dict[str, Any] | None,
    ended_by: str,
) -> tuple[str, dict[str, Any]]:
    """One input line's line in the output or the error file."""
    line_id = "batch_req_" + hashlib.sha256(f"{batch_id}:{number}".encode()).hexdigest()[:24]
    # A refused line's id is the one the translator read and used up, or none: a line it refused
    # unread (too long) names none, or a later line naming that id would answer under it too (review,
    # helper-89). A line never reached is named from its text.
    custom_id = entry.get("custom_id") if entry is not None else custom_id_of(raw)
    base = {"id": line_id, "custom_id": custom_id}
    never_ran = {
        **base,
        "response": None,
        "error": {
            "code": _ENDED.get(ended_by, "batch_cancelled"),
            "message": f"the batch was {ended_by or 'cancelled'} before this request ran",
        },
    }
    if entry is None:
        return "errors", never_ran
    if "invalid" in entry:
        status, error = _refusal(str(entry["invalid"]))
        return "errors", {
            **base,
            "response": {"status_code": status, "request_id": None, "body": {"error": error}},
            "error": None,
        }
    code = ((result or {}).get("error") or {}).get("code")
    if result is None or code == "cancelled":
        return "errors", never_ran if ended_by or code == "cancelled" else {
            **base,
            "response": None,
            "error": {"code": "result_missing", "message": "the job has no result"},
        }
    job_id = tenants.own_view(str(entry["job_id"]))  # the batch's owner reads it: ids as it names them
    status, body = completion({**result, "job_id": job_id})
    response = {"status_code": status, "request_id": job_id, "body": body}
    return ("output" if status == 200 else "errors"), {**base, "response": response, "error": None}


def _refusal(reason: str) -> tuple[int, dict[str, Any]]:
    """A refused line's answer: the translation's own ({status, error}), or a backlog reason as 400."""
    try:
        data = json.loads(reason)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return int(data.get("status", 400)), dict(data["error"])
    return 400, {"message": reason, "type": "invalid_request_error", "param": None, "code": "invalid_request"}


def drop_input_copy(backlog: Any, key: str) -> None:
    """A final batch's copy of its input file goes: its lines live on in the output and error files,
    and a client deleting its input file expects its photos and questions gone with it, not kept
    beside the run for good (review, helper-115). One a failed delete leaves, the bucket's lifecycle
    rule for `runs/` takes (docs/operations.md, "What S3 keeps")."""
    with contextlib.suppress(Exception):  # never a batch's end undone by it
        backlog.files.delete(key)
