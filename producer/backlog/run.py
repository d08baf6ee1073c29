"""Backlog runs: a manifest in, its jobs on the backlog lane (this module), a results file out
(producer/backlog/report.py, which `Backlog` also answers for: status, report, cancel). Resumable.

The manifest is read as a stream in chunks of `CHUNK_LINES` lines. For each chunk: lines are checked,
local images uploaded (once each, concurrently), the jobs recorded and queued in one Lua step each
(one round trip per part of a chunk, shared/runs.py), and then the chunk's index is written to S3:
`runs/<run_id>/index/<chunk>.jsonl`, one entry per line (its job id, or why it is invalid). A chunk
queued slowly has a partial index meanwhile, for readers (producer/backlog/chunk_index.py).

Resuming (the same manifest under the same run id, or `--resume`) skips every chunk whose index exists
and re-runs the others, where a job id that already has a record is never queued again: nothing is
enqueued twice and nothing is missing, wherever the previous producer was killed. The index is also
what `status`, `report` and `cancel` read, in manifest order, without holding the run in memory.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from producer.backlog import chunk_index, manifest
from producer.backlog.chunk_index import ChunkIndex
from producer.backlog.manifest import Invalid, Line
from producer.backlog.messages import Messages
from producer.backlog.report import RunReader
from producer.intake.intake import Intake
from producer.intake.request import Submission
from producer.queue.sender import Queue
from shared import backlog_share
from shared.errors import MrcError, QueueFull, StoreUnavailable, UsageError
from shared.jobs import Job, parse_rfc3339
from shared.records import RECORD_TTL_S, connect
from shared.runs import CANCELLED, FULL, PartNotReplicated, RunRecords
from shared.settings import Settings
from shared.stores import RunFiles, open_run_files

CHUNK_LINES = 5000
_PART = 500  # jobs per enqueue round trip (fewer when the lane has less room)
# A chunk's local photos uploaded at once: each a round trip of S3's, each file read whole in its
# thread (memory: this many photos at a time), so fewer than a Batch's, whose bytes are in memory.
_UPLOAD_THREADS = 16
_READ_THREADS = 16
_REUSED = (
    "custom_id already used in this run by another job (image, prompt, max_new_tokens or response_format)"
)


@dataclass
class Progress:
    """What an enqueue has done so far (this process), for the progress display and the summary."""

    run_id: str
    lines: int = 0
    valid: int = 0
    invalid: int = 0
    enqueued: int = 0
    already: int = 0  # queued, running or done before (a resume, or a second run of one manifest)
    uploaded: int = 0
    waiting_for_room: bool = False
    waiting_why: str = ""  # why there is no room: the depth limit, or the run's key's share of the lane
    started: float = field(default_factory=time.monotonic)

    def snapshot(self) -> dict[str, Any]:
        data = asdict(self)
        elapsed = max(1e-9, time.monotonic() - data.pop("started"))
        data["lines_per_s"] = round(self.lines / elapsed, 1)
        return data


OnProgress = Callable[[Progress], None]
Parse = Callable[[int, bytes, str, Settings], "Line | Invalid | None"]


@dataclass
class _Pass:
    """One enqueue pass over a run's manifest: what each chunk's steps share."""

    run_id: str
    progress: Progress
    block: bool
    throttle: _Throttle
    on_progress: OnProgress | None
    parse: Parse
    partials: set[int]  # chunks a killed pass left a partial index of (deleted once indexed whole)
    pass_id: str  # the run's record counts this pass's chunks only while it names this pass
    lines_shown: int = 0  # lines of the chunk being queued already in the progress's count
    until: float | None = None  # time.monotonic() past which waiting (for room, or --rate) stops: TimedOut


class Backlog(RunReader):
    def __init__(
        self,
        queue: Queue,
        runs: RunRecords | None = None,
        files: RunFiles | None = None,
        intake: Intake | None = None,
    ) -> None:
        self.queue = queue  # sends parts through its broker, reads results back (a Client is one)
        self.settings = queue.settings
        self.intake = intake or Intake(queue.settings, queue.images)
        self.runs = runs or RunRecords(
            connect(self.settings, self.settings.connect_timeout_s, retries=3),
            self.settings.redis_wait_replicas,
            self.settings.redis_wait_timeout_ms,
        )
        self.files = files or open_run_files(self.settings)
        # One capture at a time inside: mrc-api enqueues several batches at once through its one
        # producer, and a channel's capture is its own state (review: another thread's messages were sent
        # for real, outside the step that records them, and lines were refused whose jobs then ran).
        self.messages = Messages(queue.celery)

    # ------------------------------------------------------------------ enqueue
    def enqueue(
        self,
        lines: Iterable[tuple[int, bytes]],
        run_id: str,
        source: str,
        *,
        block: bool = True,
        rate: float | None = None,
        on_progress: OnProgress | None = None,
        parse: Parse = manifest.parse,
        workdir: str | None = None,
        until: float | None = None,
    ) -> Progress:
        """Enqueue a manifest's lines under `run_id`; returns what this call did. `parse` reads one
        line (another format's lines: an OpenAI batch file, producer/openai/batch_lines.py). `until`:
        a time.monotonic() past which waiting for room, or pacing at `rate`, raises TimedOut (`mrc
        backlog --wait --timeout`), what was queued indexed as for a full lane without `block`."""
        if not manifest.RUN_ID_RE.match(run_id):
            raise UsageError(f"run id {run_id[:70]!r}: {manifest.RUN_ID_RULE}")
        pass_id = uuid.uuid4().hex
        record = self.runs.start(run_id, source, workdir, pass_id)
        if record.get("state") == "cancelled" or self.cancel_marked(run_id):  # the mark: Redis lost the state
            self.runs.update(run_id, state="cancelled")
            raise UsageError(f"run {run_id} was cancelled; start a new run id")
        self.queue.results.ensure_bucket()
        done, partials = chunk_index.listed(self.files.list_keys(self._key(run_id, "index/")))
        fresh = "lines" not in record  # with chunks indexed: Redis lost the run's record (counted anew)
        young = self._young(run_id, record, fresh, bool(done))
        unconfirmed = unconfirmed_chunks(record)  # indexed, but not every job of it confirmed by the replicas
        progress = Progress(run_id)
        step = _Pass(
            run_id, progress, block, _Throttle(rate), on_progress, parse, partials, pass_id, until=until
        )
        if on_progress:  # the display's first line at once, not after a chunk of 5,000 lines
            on_progress(progress)
        for number, chunk in manifest.chunks(lines, CHUNK_LINES):
            if number in done:  # enqueued by an earlier pass: its index says
                self._go_over(step, number, chunk, fresh, young, number in unconfirmed)
            else:
                left = self._left_by_kill(run_id, number, chunk) if number in partials else None
                self._enqueue_chunk(step, number, chunk, earlier=left)
            if number in partials:  # indexed whole before a kill came between the write and the delete
                self.files.delete(chunk_index.key_of(self._key(run_id, "index/"), number, partial=True))
                partials.discard(number)
            if on_progress:
                on_progress(progress)
        if not self.runs.finish_enqueue(run_id, pass_id):  # a cancel that came after the last job stays
            raise _cancelled(run_id)
        return progress

    def _young(self, run_id: str, record: dict[str, str], fresh: bool, indexed: bool) -> bool:
        """Whether the run began within its jobs' records' 7 days: only then is a job without a record
        lost (after, every finished job has none, and one that failed without a stored result would
        be run again: review). Its start is kept beside its index (`started_at`), written from the
        run's record by the first pass that finds none: a record made anew, after Redis lost it or it
        expired (30 days), reads as a run begun now (review, helper-66/67). A run indexed before that
        mark whose record went too is taken as old; a mark that is no date, likewise."""
        started = self._key(run_id, "started_at")
        mark = (self.files.get_text(started) or "").strip()
        if not mark:
            if fresh and indexed:
                return False
            mark = record.get("created_at") or ""
            self.files.put_text(started, mark)
        try:
            begun = parse_rfc3339(mark).timestamp()
        except ValueError:
            return False
        return time.time() - begun < RECORD_TTL_S - 3600

    def _go_over(
        self,
        step: _Pass,
        number: int,
        chunk: list[tuple[int, bytes]],
        fresh: bool,
        young: bool,
        unconfirmed: bool = False,
    ) -> None:
        """A chunk an earlier pass indexed: what it queued that Redis lost (no record, no result: Redis
        restarted without its data) is queued again, and lines the index does not hold (the manifest
        grew since: a partial last chunk then, or a listing's new objects, or lines a pass cut short
        left) are queued now (review, helper-63: both were skipped, exit 0, and those jobs never ran).
        `unconfirmed`: the replicas did not confirm the pass that indexed it, and a failover may have
        lost any of its jobs: each is queued again where it has no record (review, helper-77: the whole
        chunk was queued anew over its blanked lines, and its index written empty)."""
        known = chunk_index.entries_of(self.files.get_text(self._index_key(step.run_id, number)) or "")
        given = {n for n, raw in chunk if raw.strip()}  # an OpenAI batch's resume blanks indexed lines
        if unconfirmed:
            lost = {int(e["line"]) for e in known if "job_id" in e and int(e["line"]) in given}
        else:
            lost = {n for n in self._lost(known) if n in given} if young else set()
        kept = [entry for entry in known if int(entry["line"]) not in lost]
        invalid = sum(1 for entry in kept if "invalid" in entry)
        if fresh:  # the run's record went with Redis: its counts start again from the index
            self.runs.count(
                step.run_id, step.pass_id, lines=len(kept), valid=len(kept) - invalid, invalid=invalid
            )
        step.progress.invalid += invalid
        step.progress.already += len(kept) - invalid
        step.progress.lines += len(kept)
        again = [(n, raw) for n, raw in chunk if n in lost]
        if again:  # counted by the pass that indexed them, unless the record went too
            earlier = [entry for entry in known if int(entry["line"]) in lost]
            kept = self._enqueue_chunk(step, number, again, again=not fresh, known=kept, earlier=earlier)
        grown = _unindexed(chunk, kept)
        if grown:
            self._enqueue_chunk(step, number, grown, known=kept)
        if unconfirmed and all(int(e["line"]) in given for e in known if "job_id" in e):
            self.runs.forget(step.run_id, _UNCONFIRMED + str(number))  # each of its jobs gone over, confirmed

    def _left_by_kill(self, run_id: str, number: int, chunk: list[tuple[int, bytes]]) -> list[dict[str, Any]]:
        """The entries of the partial index a pass that was cut short left for a chunk it never
        indexed whole: what it queued, kept by this pass until its own entry for the line replaces it
        (review, helper-76: a resume that found the lane full at once wrote the whole index without
        them, and status, report and cancel lost sight of jobs that were queued)."""
        key = chunk_index.key_of(self._key(run_id, "index/"), number, partial=True)
        lines = {n for n, _ in chunk}
        return [e for e in chunk_index.entries_of(self.files.get_text(key) or "") if int(e["line"]) in lines]

    def _lost(self, entries: list[dict[str, Any]]) -> set[int]:
        """The lines of `entries` whose job has neither a record nor a result."""
        queued = [entry for entry in entries if "job_id" in entry]
        recorded = self.runs.recorded([entry["job_id"] for entry in queued])
        gone = [entry for entry, found in zip(queued, recorded, strict=True) if not found]
        if not gone:
            return set()
        with ThreadPoolExecutor(_UPLOAD_THREADS) as pool:
            stored = list(pool.map(lambda e: self.queue.results.has_result(e["job_id"]), gone))
        return {int(entry["line"]) for entry, done in zip(gone, stored, strict=True) if not done}

    def _enqueue_chunk(
        self,
        step: _Pass,
        number: int,
        chunk: list[tuple[int, bytes]],
        again: bool = False,
        known: list[dict[str, Any]] | None = None,
        earlier: list[dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """`again`: lines an earlier pass indexed and counted, queued again (Redis lost their jobs, or
        the replicas did not confirm them), their entries then being `earlier`; `known`: the index
        entries of the chunk's other lines an earlier pass queued (`chunk` is the rest)."""
        run_id, progress = step.run_id, step.progress
        index = ChunkIndex(
            self.files, self._key(run_id, "index/"), number, known, earlier, number in step.partials
        )
        jobs, entries = self._jobs(step, chunk)
        step.lines_shown = 0
        index.entries.extend(entries)
        entries = index.entries  # _queue adds each queued job's entry
        unreplicated: PartNotReplicated | None = None
        full: QueueFull | None = None
        try:
            stopped = self._queue(step, jobs, index)
        except PartNotReplicated as exc:  # what is queued is indexed (status sees it) and flagged, so a
            stopped, unreplicated = False, exc  # resume goes over the chunk again (it queues nothing twice)
            self.runs.update(run_id, **{_UNCONFIRMED + str(number): "1"})
        except QueueFull as exc:  # --no-block: what is queued is indexed, so status, report and cancel
            stopped, full = False, exc  # see it (review: 0/0 with 30 queued); a resume queues the rest
        invalid = sum(1 for e in entries if "invalid" in e)
        # The earlier entries of lines queued again stay where a full lane left them unqueued: the
        # next pass finds them lost again, and counts them no second time (review, helper-65).
        entries_kept = index.kept()
        indexed = index.write()
        step.partials.discard(number)
        if not again:  # lines left unqueued (a full lane, replicas that did not confirm a part) are
            # counted when a resume queues them (review, helper-77: `valid` stayed short for good)
            left = len(_unindexed(chunk, entries_kept)) if full is not None or unreplicated is not None else 0
            bad = sum(1 for e in entries_kept if "invalid" in e)
            self.runs.count(
                run_id, step.pass_id, lines=len(chunk) - left, valid=len(entries_kept) - bad, invalid=bad
            )
        elif earlier:  # lost jobs (valid then) whose lines are invalid now: counted as what they are
            self.runs.count(run_id, step.pass_id, valid=-invalid, invalid=invalid)
        if unreplicated is not None:
            raise unreplicated
        if full is not None:
            raise full
        progress.lines += len(chunk) - step.lines_shown
        progress.valid += len(entries) - invalid
        progress.invalid += invalid
        if stopped:  # the index holds what was queued before the cancel: status and report see it
            ids = [str(e["job_id"]) for e in entries if "job_id" in e]
            self.runs.count(run_id, cancelled=self.runs.cancel_many(ids))  # cancel() saw the indexed only
            raise _cancelled(run_id)
        return indexed

    def _jobs(
        self, step: _Pass, chunk: list[tuple[int, bytes]]
    ) -> tuple[list[tuple[Line, Job]], list[dict[str, Any]]]:
        """A chunk's lines as jobs to queue, and the index entries of those that are invalid."""
        parsed = [p for n, raw in chunk if (p := step.parse(n, raw, step.run_id, self.settings)) is not None]
        images = self._upload([p.image for p in parsed if isinstance(p, Line)], step.progress)
        entries: list[dict[str, Any]] = []
        jobs: list[tuple[Line, Job]] = []
        for item in parsed:
            if isinstance(item, Line) and isinstance(images.get(item.image, item.image), str):
                try:
                    jobs.append((item, self._job(item, images)))
                    continue
                except (MrcError, ValueError) as exc:
                    item = Invalid(item.number, str(getattr(exc, "message", exc))[:300], item.custom_id)
            elif isinstance(item, Line):
                item = Invalid(item.number, str(images[item.image]), item.custom_id)
            entries.append(_invalid_entry(item))
        return jobs, entries

    def _queue(self, step: _Pass, jobs: list[tuple[Line, Job]], index: ChunkIndex) -> bool:
        """Queue a chunk's jobs in parts that fit the lane's room, adding their index entries; True when
        the run was cancelled meanwhile (what was queued before stays, the rest is never queued). The
        depth limit and the cancel are both decided per job inside the enqueue step, never from a read
        made before it."""
        run_id, progress = step.run_id, step.progress
        at = 0
        while at < len(jobs):
            room = self._wait_for_room(
                run_id, progress, step, index, backlog_share.owner_of(jobs[at][1].job_id)
            )
            if room is None:  # cancelled while it waited
                return True
            part = jobs[at : at + step.throttle.part(min(_PART, room.room))]
            limit = self.settings.backlog_max_depth
            if step.until is not None and step.throttle.due() >= step.until:  # review, helper-111: a
                rate = step.throttle.rate  # --rate run went on 28 h past its --timeout
                raise TimedOut(room.depth, limit, f"pacing its lines at --rate {rate:g} a second")
            step.throttle.take(len(part))
            unreplicated: PartNotReplicated | None = None
            try:
                captured = self.messages.queued([job for _, job in part], self._ahead(room))
                replies = self.runs.enqueue_many(run_id, captured, limit, self.settings.backlog_key_shares)
            except PartNotReplicated as exc:  # queued on the master; counted below, then the run stops
                replies, unreplicated = exc.replies, exc
            went = _took(part, replies, index.entries, progress)
            at, progress.lines, step.lines_shown = at + went, progress.lines + went, step.lines_shown + went
            if unreplicated is not None:
                # What is queued is indexed and the chunk flagged: a resume queues each of its jobs again
                # where a failover lost it, and the rest. Nothing past it is queued unconfirmed.
                raise unreplicated
            if CANCELLED in replies:
                return True
            index.grew()
            if step.on_progress:  # a part at a time (review, helper-74: a --rate run said nothing for
                step.on_progress(progress)  # a whole chunk; cron logs got no line per --interval)
        return False

    def _job(self, line: Line, images: dict[str, str | Exception]) -> Job:
        """The line's job through the one intake (its image already an s3:// URI: uploaded above)."""
        image = line.image if line.image.startswith("s3://") else images[line.image]
        assert isinstance(image, str)
        sub = Submission(
            image=image,
            prompt=line.prompt,
            job_id=line.job_id,  # a batch's goes into its key's namespace (shared/tenants.py)
            lane="backlog",
            max_new_tokens=line.max_new_tokens,
            ticket_id=line.ticket_id,
            response_format=line.response_format,
            api_key=line.api_key,
            truncate=line.truncate,
        )
        return self.intake.job(sub)

    def _upload(self, images: list[str], progress: Progress) -> dict[str, str | Exception]:
        """Local paths of a chunk uploaded once each, concurrently: path -> URI, or the error."""
        local = sorted({image for image in images if not image.startswith("s3://")})

        def upload(path: str) -> str | Exception:
            try:
                return self.intake.upload_image(Path(path))[0]
            except (MrcError, OSError) as exc:
                return exc

        with ThreadPoolExecutor(_UPLOAD_THREADS) as pool:
            uris = dict(zip(local, pool.map(upload, local), strict=True))
        away = next((uri for uri in uris.values() if isinstance(uri, StoreUnavailable)), None)
        if away is not None:  # S3 away is not the line's fault: raised (mrc backlog waits it out and
            raise away  # resumes; review: the lines were indexed invalid for good, a resume kept them so)
        progress.uploaded += sum(1 for uri in uris.values() if isinstance(uri, str))
        return uris

    def _wait_for_room(
        self, run_id: str, progress: Progress, step: _Pass, index: ChunkIndex, owner: str
    ) -> backlog_share.Room | None:
        """The room the backlog lane has now for the run's owner (its depth limit, and the owner's
        share while other keys have work in it), waiting while it has none (or raising QueueFull
        without `block`); None when the run was cancelled while it waited."""
        limit = self.settings.backlog_max_depth
        while (room := self.queue.backlog_room(owner)).room <= 0:
            why = room.refusal(limit, self.settings.backlog_key_shares, owner)
            if not step.block:
                raise QueueFull(room.depth, limit, why)
            if step.until is not None and time.monotonic() >= step.until:
                raise TimedOut(
                    room.depth, limit, f"waiting for room on the backlog lane: {why or 'at its limit'}"
                )
            if self.runs.cancelled(run_id):
                return None
            index.grew(waiting=True)  # what is queued so far is seen while the run waits
            progress.waiting_for_room, progress.waiting_why = True, why or "at its depth limit"
            if step.on_progress:
                step.on_progress(progress)
            time.sleep(0.5)
        progress.waiting_for_room, progress.waiting_why = False, ""
        return room

    def _ahead(self, room: backlog_share.Room) -> int:
        """How many of the next jobs go on the lane's ahead list (backlog_share.Room.ahead_for), from
        the run's last look at the room: a hint of order, not a limit (two runs at once may each
        put that many ahead)."""
        return room.ahead_for(self.settings.backlog_ahead_jobs)


_UNCONFIRMED = "unconfirmed_chunk_"


class TimedOut(QueueFull):
    """The run waited past its `until`, for room on the backlog lane or at its --rate (`then` says
    which); what was queued is indexed."""


def _took(
    part: list[tuple[Line, Job]], replies: list[int | str], entries: list[dict[str, Any]], progress: Progress
) -> int:
    """What the enqueue step made of a part, in its index entries and the progress; how many of its
    jobs it went through (up to the first it did not queue: the lane full, or the run cancelled)."""
    went = 0
    for (line, job), reply in zip(part, replies, strict=True):
        if reply in (CANCELLED, FULL):
            break  # this job and the rest of the part: not queued
        went += 1
        if reply == 1:
            progress.enqueued += 1
        elif reply in (job.fingerprint(), ""):  # '': the record a worker wrote anew after Redis lost the
            progress.already += 1  # producer's (the worker takes it as this job: review, helper-76)
        else:
            entries.append(_invalid_entry(Invalid(line.number, _REUSED, line.custom_id)))
            continue
        entries.append({"line": line.number, "custom_id": line.custom_id, "job_id": job.job_id})
    return went


def unconfirmed_chunks(record: dict[str, str]) -> set[int]:
    """The chunks a run's record flags: indexed, but a part of them not confirmed by the replicas."""
    return {int(key.removeprefix(_UNCONFIRMED)) for key in record if key.startswith(_UNCONFIRMED)}


def _unindexed(chunk: list[tuple[int, bytes]], entries: list[dict[str, Any]]) -> list[tuple[int, bytes]]:
    """The chunk's lines no index entry holds, blank ones left out (they never have one)."""
    indexed = {int(entry["line"]) for entry in entries}
    return [(n, raw) for n, raw in chunk if n not in indexed and raw.strip()]


def _invalid_entry(item: Invalid) -> dict[str, Any]:
    entry: dict[str, Any] = {"line": item.number, "invalid": item.reason}
    if item.custom_id is not None:
        entry["custom_id"] = item.custom_id
    return entry


def _cancelled(run_id: str) -> UsageError:
    return UsageError(f"run {run_id} was cancelled while it was being enqueued")


class _Throttle:
    """At most `rate` lines a second (None: no limit), in steps of a part."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.next = time.monotonic()

    def part(self, most: int) -> int:
        """A part's size: at most a second's worth of lines (review: a whole part of 500 went at once,
        so a run of fewer lines, and the start of any run, was not held to the rate at all)."""
        return min(most, max(1, int(self.rate))) if self.rate else most

    def due(self) -> float:
        """When the next part may go (time.monotonic())."""
        return max(time.monotonic(), self.next) if self.rate else time.monotonic()

    def take(self, count: int) -> None:
        if not self.rate:
            return
        now = time.monotonic()
        if self.next > now:
            time.sleep(self.next - now)
        self.next = max(now, self.next) + count / self.rate
