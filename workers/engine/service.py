"""The engine's own thread: the only thread that calls the model.

Delivery threads hand rows in (`submit` -> a Future) and wait; the loop takes what arrived, runs one
engine step, and resolves each row's future the moment it finishes. A device fault ends the loop:
every row in hand (and every later submit) gets the WorkerUnusable, so each delivery thread takes
the worker's exit path (give back, exit unacked).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from shared import logs
from shared.errors import AnswerIncomplete, WorkerUnusable
from workers.engine import scheduler
from workers.engine.engine import Engine, StepReport
from workers.engine.sequence import Sequence
from workers.engine.step import StepModel
from workers.metrics import Metrics
from workers.streaming import TextStreams

_IDLE_WAIT_S = 1.0
# A step that moved no row (every waiting row held back by the policy) is not run again before this
# long, or before new work arrives: the loop never spins a core on rows that cannot move.
_STALLED_WAIT_S = 0.05


class EngineService:
    def __init__(
        self,
        runner: StepModel,
        limits: scheduler.Limits,
        metrics: Metrics,
        on_progress: Callable[[float], None] = lambda busy_s: None,
        clock: Callable[[], float] = time.time,
        streams: TextStreams | None = None,
    ) -> None:
        self.engine = Engine(runner, limits, self._finished, clock)
        self.metrics, self.on_progress, self.clock = metrics, on_progress, clock
        self.log = logs.get_logger()
        self._inbox: list[tuple[Sequence, Future[Sequence]]] = []
        self._futures: dict[str, Future[Sequence]] = {}
        self.streams = streams
        # Rows whose text is published as it is decoded, and how many tokens each had when last offered.
        self._streaming: dict[str, tuple[Sequence, int]] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._closed = False  # the loop has returned: a row handed in now fails at once
        self.fatal: BaseException | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="mrc-engine", daemon=True)
        metrics.slots.set(limits.max_rows)

    def start(self) -> EngineService:
        self._thread.start()
        return self

    def row_id(self, job_id: str) -> str:
        """Unique within the process, even for two deliveries of one job."""
        return f"{next(self._ids)}:{job_id}"

    @property
    def idle(self) -> bool:
        """No row in hand, handed in or in the engine (read from any thread)."""
        with self._cond:
            return not self._inbox and not self._futures

    def submit(self, row: Sequence) -> Future[Sequence]:
        return self.submit_many([row])[0]

    def submit_many(self, rows: list[Sequence]) -> list[Future[Sequence]]:
        """Hand rows in at once: the engine takes them at the same step (a group's members together)."""
        futures: list[Future[Sequence]] = [Future() for _row in rows]
        now = self.clock()
        with self._cond:
            for row, future in zip(rows, futures, strict=True):
                row.submitted_at = now
                if self.fatal is not None:
                    future.set_exception(self.fatal)
                elif self._closed:  # the loop has ended (the worker closing): nothing would take it
                    future.set_exception(WorkerUnusable("the engine has stopped: the worker is closing"))
                else:
                    self._inbox.append((row, future))
            self._cond.notify()
        return futures

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---------------------------------------------------------------- the loop
    def _loop(self) -> None:
        moved = True
        while self._take(moved):
            began = time.perf_counter()
            try:
                report = self.engine.step()
            except BaseException as exc:  # a device fault (or a bug in the engine): nothing can run now
                self._die(exc)
                return
            moved = report.moved
            self._account(report, time.perf_counter() - began)
            self._offer_text()

    def _take(self, moved: bool = True) -> bool:
        """Wait for work; move what arrived into the engine. False once stopping and idle. After a
        step that moved no row, wait a little for new work before the next one."""
        with self._cond:
            if not moved and not self._inbox and not self._stopping:
                self._cond.wait(_STALLED_WAIT_S)
            while not self._inbox and self.engine.idle:
                if self._stopping:
                    self._closed = True
                    return False
                self._cond.wait(_IDLE_WAIT_S)
            inbox, self._inbox = self._inbox, []
            for row, future in inbox:  # in hand all along, for `idle` read on another thread
                self._futures[row.row_id] = future
        for row, _future in inbox:
            if row.stream_to is not None and self.streams is not None:
                self._streaming[row.row_id] = (row, 0)
            self.engine.submit(row)
        return True

    def _offer_text(self) -> None:
        """Each streaming row's tokens, when they changed this step (a copy: the publisher's thread
        decodes and writes them; this thread never waits for Redis)."""
        if self.streams is None:
            return
        for row_id, (row, offered) in list(self._streaming.items()):
            if len(row.tokens) != offered:
                assert row.stream_to is not None
                self.streams.offer(row.stream_to, row.tokens)
                self._streaming[row_id] = (row, len(row.tokens))

    def _finished(self, row: Sequence) -> None:
        future = self._futures.pop(row.row_id, None)
        if self._streaming.pop(row.row_id, None) is not None and self.streams is not None:
            assert row.stream_to is not None
            self.streams.offer(row.stream_to, row.tokens, ended=True)
        # A finished row is never recomputed: its inputs (the image's patches, on the device) go now,
        # not when the last row of its delivery is handed back.
        row.inputs = None
        # A row that ended before it was ever admitted (past its deadline, cancelled, failed while it
        # waited) waited all its time: the overloaded worker's, which MrcInteractiveWaitInWorkersTooLong
        # pages on (review, helper-117: such rows were never counted).
        admitted = row.first_admitted_at if row.first_admitted_at is not None else self.clock()
        self.metrics.admission_wait.labels(lane=row.lane).observe(max(0.0, admitted - row.submitted_at))
        # The tokens of its answer, counted once it is whole: end-of-text is not one, and neither are
        # the tokens of a run that was paused, restarted or failed (mrc_engine_discarded_tokens_total).
        # An incomplete structured answer's are its answer's: handed out and billed (review).
        kept = row.error is None or isinstance(row.error, AnswerIncomplete)
        (self.metrics.generated if kept else self.metrics.discarded).inc(len(row.tokens))
        if future is not None:
            future.set_result(row)

    def _die(self, exc: BaseException) -> None:
        fatal = (
            exc if isinstance(exc, WorkerUnusable) else WorkerUnusable(f"the engine failed: {exc!r}"[:500])
        )
        self.log.critical("MRC_ENGINE_FAILED", error=repr(exc)[:500], rows=len(self._futures))
        with self._cond:
            self.fatal = fatal
            inbox, self._inbox = self._inbox, []
        for _row, future in inbox:
            future.set_exception(fatal)
        for future in self._futures.values():
            future.set_exception(fatal)
        self._futures.clear()
        self._streaming.clear()

    def _account_prefill(self, report: StepReport) -> None:
        metrics = self.metrics
        metrics.prefill_computed.inc(report.computed)
        metrics.prefill_calls.inc(report.calls)
        metrics.prefix_lookups.inc(report.lookups)
        metrics.prefix_hits.inc(report.hits)
        metrics.prefix_reused.inc(report.reused)
        table = getattr(self.engine.runner, "table", None)
        metrics.prefix_cached.set(table.cached if table is not None else 0)
        metrics.kv_reserved.set(table.reserved if table is not None else 0)

    def _account(self, report: StepReport, seconds: float) -> None:
        engine, metrics = self.engine, self.metrics
        ran = report.computed or report.decoded_rows or report.restarted
        if ran:
            metrics.steps.inc()
            metrics.model_busy.inc(seconds)
        if report.discarded:
            metrics.discarded.inc(report.discarded)
        self._account_prefill(report)
        if report.decoded_rows:
            batch = engine.batch
            metrics.model_batch_jobs.observe(report.decoded_rows)
            metrics.model_batch_tokens.observe(batch.read)
            metrics.positions_read.inc(batch.read)
            metrics.positions_padding.inc(batch.padding)
            metrics.padding.observe(padding(engine))
        if report.paused:
            metrics.paused.labels(reason="ticket").inc(report.paused)
            self.log.info("MRC_ENGINE_PAUSED", rows=report.paused, running=len(engine.running))
        if report.restarted:
            metrics.paused.labels(reason="failed_step").inc(report.restarted)
            self.log.warning("MRC_ENGINE_STEP_FAILED", rows=report.restarted, row_ceiling=engine.row_ceiling)
        metrics.rows_running.set(len(engine.running))
        metrics.rows_held.set(len(engine.held))
        metrics.backlog_stalled.set(engine.backlog_stalled)
        waiting = {"interactive": 0, "backlog": 0}
        for row in engine.waiting:
            waiting[row.lane] = waiting.get(row.lane, 0) + 1
        for lane, count in waiting.items():
            metrics.rows_waiting.labels(lane=lane).set(count)
        metrics.kv_used.set(engine.positions_held)
        metrics.slots_used.set(engine.in_memory)
        if report.moved:  # progress is a row that got somewhere, not a step taken (/healthz)
            self.on_progress(seconds)


def padding(engine: Engine) -> float:
    """Share of the cache positions the last decode step read that were padding, not a row's own."""
    batch = engine.batch
    return batch.padding / batch.read if batch.read else 0.0
