"""A streamed chat answer (`stream: true`): server-sent events in OpenAI's chunk shape, relayed from
the job's Redis stream (written by the worker as the text is decoded, workers/streaming.py).

The request is checked and enqueued exactly as a plain one (producer/openai/chat.py): anything that
goes wrong up to the push is the usual JSON error, before the first byte. Then an SSE comment (the
stream is open) and the events: a first chunk with the role, once the model's name is known (the
worker's first text says it, or the result does: every chunk names the model as the plain answer
does, not as the request did, and a worker may be loading still, or none up yet, when it comes),
content deltas as the worker publishes them, and once the job's result is
stored, the rest of its text (whatever the stream missed: a trimmed stream, a Redis failover, a
stream that was never written, for a job that ended before its row ran), a last chunk with the
finish reason, a usage chunk when `stream_options.include_usage` asks, and `data: [DONE]`. The
joined deltas are the result's text: the stream only ever carries a prefix of it.

A job that fails, or a wait that runs out (MRC_OPENAI_WAIT_S), ends the stream with an error event in
OpenAI's shape (`data: {"error": {...}}`, naming the job) and no `[DONE]`. A client that goes away
cancels nothing: the job runs on and its result is stored as for any job (`GET /v1/jobs/ID/result`).
SSE comments keep a quiet connection alive while the job waits in the queue.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from producer.http.state import ApiState
from producer.openai.completion import completion, epoch
from producer.openai.errors import OpenAIError
from shared import logs, names
from shared.records import TERMINAL

RECORD_EVERY_S = 0.25  # the job's record is looked at this often (its end, when no stream says it)
# Once the worker said the row ended, its result is being written: looked for this often, for at most
# ENDED_LOOK_S (a row that ended in a retryable failure runs again later: back to RECORD_EVERY_S).
ENDED_EVERY_S, ENDED_LOOK_S = 0.02, 2.0
BLOCK_S = 0.25  # one XREAD waits at most this long
OUTAGE_PAUSE_S = 0.5  # after a failed read (Redis away), the next one waits this long
KEEPALIVE_S = 10.0


@dataclass
class StreamedJob:
    job_id: str  # as stored (a key's namespace included)
    shown_id: str  # as the client names it
    model: str  # the name the answer is expected to carry, until the worker or the result says it
    created: int
    include_usage: bool
    wait_s: float
    keepalive_s: float = KEEPALIVE_S  # a silence longer than this gets a comment


@dataclass
class _Relay:
    text: str = ""  # what was sent so far
    after: str = "0"  # the last stream entry read
    ended_at: float | None = None  # when the worker said the row ended: its result is coming
    model: str | None = None  # the model's name, as the worker's stream says it
    opened: bool = False  # the role chunk was sent (it names the model: every later chunk names it so)
    outage: bool = False
    result: dict[str, Any] | None = field(default=None)
    next_look: float = 0.0  # when the result is looked for next
    reading: asyncio.Task[Any] | None = None  # the read of the stream under way
    looking: asyncio.Task[Any] | None = None  # the look at the result under way


def _taken(relay: _Relay, which: str) -> Any:
    """A finished task's value (and the task forgotten, so the next one starts); None while it runs."""
    task = getattr(relay, which)
    if task is None or not task.done():
        return None
    setattr(relay, which, None)
    return task.result()


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


class ChatStream:
    def __init__(self, state: ApiState) -> None:
        self.state = state

    def chunk(self, job: StreamedJob, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": job.shown_id,
            "object": "chat.completion.chunk",
            "created": job.created,
            "model": job.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if job.include_usage:
            out["usage"] = None
        return out

    async def events(self, job: StreamedJob) -> AsyncIterator[bytes]:
        relay = _Relay()
        log = logs.get_logger()
        try:
            yield b": queued\n\n"
            async for piece in self._relay(job, relay):
                yield piece
        except (asyncio.CancelledError, GeneratorExit):
            if relay.result is None:
                log.info("MRC_STREAM_LEFT", job_id=job.job_id, chars_sent=len(relay.text))
            raise

    async def _relay(self, job: StreamedJob, relay: _Relay) -> AsyncIterator[bytes]:
        """The loop: a read of the stream and a look at the result run as tasks, at most one of each
        at a time, and are waited for no longer than the deadline and the next keep-alive allow; a
        Redis that hangs (a read blocks up to the connection's socket timeout) holds neither back."""
        deadline = time.monotonic() + job.wait_s
        quiet_since = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    for piece in [*self._open(job, relay), sse(self._timeout(job).body())]:
                        yield piece
                    return
                if now - quiet_since >= job.keepalive_s:
                    quiet_since = now
                    yield b": keep-alive\n\n"
                ended = relay.ended_at
                pending = self._start(job, relay, now, deadline)
                budget = min(deadline - now, job.keepalive_s - (now - quiet_since))
                await asyncio.wait(pending, timeout=max(0.001, budget), return_when=asyncio.FIRST_COMPLETED)
                pieces, done = self._news(job, relay, ended)
                if pieces:
                    quiet_since = time.monotonic()
                for piece in pieces:
                    yield piece
                if done:
                    return
        finally:
            for task in (relay.reading, relay.looking):
                if task is not None:
                    task.cancel()

    def _news(self, job: StreamedJob, relay: _Relay, ended: float | None) -> tuple[list[bytes], bool]:
        """What the finished read and look bring: the events to send, and whether the stream ends."""
        out: list[bytes] = []
        delta = _taken(relay, "reading")
        if relay.ended_at != ended:  # the worker said the row ended: its result is coming
            relay.next_look = 0.0
        if delta:
            relay.text += delta
            out += [*self._open(job, relay), sse(self.chunk(job, {"content": delta}))]
        found = _taken(relay, "looking")
        if found:
            relay.result = found
            return [*out, *self._ending(job, relay, found)], True
        return out, False

    def _open(self, job: StreamedJob, relay: _Relay, result: dict[str, Any] | None = None) -> list[bytes]:
        """The role chunk, before any other event; the model it names (and every later chunk with it)
        is the worker's, else the result's, else the name expected when the request came."""
        if relay.opened:
            return []
        relay.opened = True
        named = ((result or {}).get("model") or {}).get("id")
        job.model = relay.model or (str(named) if named else job.model)
        return [sse(self.chunk(job, {"role": "assistant", "content": ""}))]

    def _start(self, job: StreamedJob, relay: _Relay, now: float, deadline: float) -> set[asyncio.Task[Any]]:
        """A read of the stream and a look at the result, unless one of each is under way already."""
        fast = relay.ended_at is not None and now - relay.ended_at < ENDED_LOOK_S
        if relay.reading is None:
            block = min(ENDED_EVERY_S if fast else BLOCK_S, deadline - now)
            relay.reading = asyncio.ensure_future(self._read(job, relay, block))
        if relay.looking is None and now >= relay.next_look:
            relay.next_look = now + (ENDED_EVERY_S if fast else RECORD_EVERY_S)
            relay.looking = asyncio.ensure_future(self._result(job.job_id))
        return {task for task in (relay.reading, relay.looking) if task is not None}

    async def _read(self, job: StreamedJob, relay: _Relay, block_s: float) -> str:
        """New text from the job's stream (what lies past what was sent), waiting up to `block_s`."""
        try:
            entries = await self.state.waits.stream(names.stream_key(job.job_id), relay.after, block_s)
        except Exception as exc:  # the job is queued: an outage is waited out, to the deadline
            if not relay.outage:
                relay.outage = True
                logs.get_logger().warning(
                    "MRC_STREAM_READ_INTERRUPTED", job_id=job.job_id, error=repr(exc)[:200]
                )
            await asyncio.sleep(min(OUTAGE_PAUSE_S, block_s))
            return ""
        relay.outage = False
        sent, out = len(relay.text), ""
        for entry_id, fields in entries:
            relay.after = entry_id
            at, text = int(fields.get("at", 0)), str(fields.get("t", ""))
            if at <= sent + len(out) < at + len(text):  # entries again from 0 (a redelivery): the new part
                out += text[sent + len(out) - at :]
            if fields.get("end"):
                relay.ended_at = time.monotonic()
            relay.model = relay.model or fields.get("m") or None
        return out

    async def _result(self, job_id: str) -> dict[str, Any] | None:
        """The job's result once it ended (the failed result its record describes, where none was
        stored); None while it runs, or while Redis or S3 cannot say."""
        try:
            record = await self.state.waits.record(job_id)
            if record and record.get("state") not in TERMINAL:
                return None
            found = await self.state.waits.result(job_id, 0, self.state.queue.result)
        except Exception:  # looked at again at the next turn
            return None
        return found if isinstance(found, dict) else None

    def _ending(self, job: StreamedJob, relay: _Relay, result: dict[str, Any]) -> list[bytes]:
        out = self._open(job, relay, result)
        sent = relay.text
        status, body = completion({**result, "job_id": job.shown_id})
        if status != 200:
            return [*out, sse(body)]
        text = str(body["choices"][0]["message"]["content"])
        if text.startswith(sent):
            if len(text) > len(sent):
                out.append(sse(self.chunk(job, {"content": text[len(sent) :]})))
        else:  # never by design (the worker publishes prefixes): said, not hidden
            logs.get_logger().error("MRC_STREAM_DIVERGED", job_id=job.job_id, chars_sent=len(sent))
        last = self.chunk(job, {}, str(body["choices"][0]["finish_reason"]))
        last["system_fingerprint"] = body.get("system_fingerprint")
        out.append(sse(last))
        if job.include_usage:
            usage = {**self.chunk(job, {}), "choices": [], "usage": body["usage"]}
            usage["system_fingerprint"] = body.get("system_fingerprint")
            out.append(sse(usage))
        out.append(sse("[DONE]"))
        return out

    def _timeout(self, job: StreamedJob) -> OpenAIError:
        return OpenAIError(
            504,
            f"no answer within {job.wait_s:g} s; job {job.shown_id} goes on: "
            f"GET /v1/jobs/{job.shown_id}/result has it once it ends",
            None,
            "answer_timeout",
            extra={"job_id": job.shown_id},
        )


def streamed_job(
    job_id: str,
    shown_id: str,
    model: str,
    submitted_at: str,
    include_usage: bool,
    wait_s: float,
    read_timeout: str | None = None,
) -> StreamedJob:
    """`read_timeout`: the SDK's `x-stainless-read-timeout`. Keep-alives come twice within it: a
    client told to give up after 4 s of silence got its first after 10 s, and gave up (review,
    helper-98; the SDK does not retry once the stream's headers came)."""
    try:
        told = float(read_timeout) if read_timeout else 0.0
    except ValueError:
        told = 0.0
    keepalive = min(KEEPALIVE_S, max(0.5, told / 2)) if told == told and told > 0 else KEEPALIVE_S
    return StreamedJob(job_id, shown_id, model, epoch(submitted_at), include_usage, wait_s, keepalive)
