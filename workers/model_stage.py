"""The model stage of a delivery: hand each job to the engine as soon as its image is decoded and its
inputs are prepared (on the delivery's thread), and take each back the moment its row finishes.

The engine (workers/engine/) runs on a thread of its own for every delivery in hand; this stage is
what one delivery does with it: decode in the pool, prepare, submit, wait, read each row into its
job's slot, and apply the failure-streak rule (a model that fails job after job is the worker's
fault, not the jobs')."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from functools import partial
from typing import Any

from shared import encoding, logs, tenants
from shared.errors import AnswerIncomplete, InternalError, InvalidJob, ModelError, MrcError, WorkerUnusable
from shared.response_format import read_output
from shared.settings import Settings
from workers import images, stages
from workers.admission import Admission
from workers.backends.base import GenerationInput, ModelBackend
from workers.cancel_watch import CancelWatch
from workers.engine import capacity, scheduler
from workers.engine.sequence import Sequence as Row
from workers.engine.service import EngineService
from workers.metrics import Metrics
from workers.photos import Decoded, Fetch, Photos
from workers.row_grammars import Ask, RowGrammars
from workers.slots import Slot
from workers.streaming import TextStreams


@dataclass(eq=False)
class _Parked:
    """A job whose model inputs are built, waiting for its grammar to settle before its row is made."""

    slot: Slot
    ask: Ask
    inputs: Any
    positions: int
    wait_s: float = 0.0


class ModelStage:
    def __init__(
        self,
        backend: ModelBackend,
        settings: Settings,
        metrics: Metrics,
        admission: Admission,
        pool: Any,  # workers/lane_pools.py LanePools: submit(slot, work, *args) -> Future
        finish: Callable[[list[Slot]], None],
        fetch: Fetch,
        streams: TextStreams | None = None,
    ) -> None:
        self.backend, self.settings, self.metrics, self.admission = backend, settings, metrics, admission
        self._pool, self._finish = pool, finish
        self._lock = threading.Lock()
        self._busy_s = 0.0
        self._first_batch_at: float | None = None
        self._failure_streak = 0  # jobs in a row the model failed (model_error), across deliveries
        self.grammars = RowGrammars(backend, settings.grammar_compile_timeout_s, metrics)
        self.photos = Photos(backend, settings, metrics, pool, fetch)
        self.engine_at = time.monotonic()  # the engine's last step (monotonic), for /healthz
        # The cache: a pool of positions, each row's slot its need (rows decode) or the longest job's
        # (fixed decode), as large as memory holds within the settings (workers/engine/capacity.py);
        # allocated once, here.
        self.positions = backend.slot_positions()
        fit, self.kv_measured = backend.kv_capacity()
        decode = str(getattr(backend, "decode_mode", lambda: "rows")())
        grain = capacity.slot_grain(decode, backend.device)
        rows, self.pool = capacity.choose(
            fit, settings.model_batch_max_jobs, settings.batch_token_budget, self.positions,
            decode == "fixed", grain,
        )  # fmt: skip
        reserved = min(settings.engine_reserved_rows, rows - 1)
        chunk = capacity.prefill_tokens(settings.engine_prefill_tokens, backend.device)
        self.limits = scheduler.Limits(
            max_rows=rows,
            reserved_interactive=reserved,
            backlog_prefill_tokens=chunk,
            backlog_share=settings.engine_backlog_share,
            prefill_tokens=chunk,
            hold_backlog=settings.engine_hold_backlog == "on"
            or (settings.engine_hold_backlog == "auto" and backend.device == "cpu"),
            reserve_positions=capacity.reserve(reserved, self.pool, self.positions, decode == "fixed", grain),
        )
        runner = backend.step_model(rows, self.positions, self.pool)
        self.cache_bytes = int(getattr(getattr(runner, "cache", None), "nbytes", 0))
        self.decode = str(getattr(runner, "decode_mode", "rows"))
        self.captured = backend.capture(runner)
        self.streams = streams
        self.engine = EngineService(runner, self.limits, metrics, self._progress, streams=streams).start()
        metrics.kv_capacity.set(self.pool)
        logs.get_logger().info(
            "MRC_ENGINE_READY", slots=rows, slot_positions=self.positions, cache_bytes=self.cache_bytes,
            cache_positions=self.pool, positions_memory_holds=fit, measured_from=self.kv_measured,
            decode=self.decode,
            cuda_graphs=self.captured, reserved_interactive=self.limits.reserved_interactive,
            hold_backlog=self.limits.hold_backlog, backlog_share=self.limits.backlog_share,
        )  # fmt: skip
        longest = getattr(getattr(backend, "grammars", None), "longest_token_chars", 0)
        if longest > settings.max_token_chars:  # the producer's bound checks assume no longer token
            logs.get_logger().warning(
                "MRC_TOKEN_CHARS_EXCEEDED",
                longest_token_chars=longest,
                max_token_chars=settings.max_token_chars,
            )

    @property
    def busy_ratio(self) -> float:
        """Share of wall time since the first delivery that the model was running."""
        if self._first_batch_at is None:
            return 0.0
        return self._busy_s / max(1e-9, time.perf_counter() - self._first_batch_at)

    def describe(self) -> dict[str, Any]:
        """The engine's limits, fixed at start (/readyz, the heartbeat)."""
        return {
            "engine_slots": self.limits.max_rows,
            "engine_slot_positions": self.positions,
            "engine_cache_positions": self.pool,
            "engine_cache_bytes": self.cache_bytes,
            "engine_kv_measured_from": self.kv_measured,
            "engine_decode": self.decode,
            "engine_cuda_graphs": self.captured,
            "engine_reserved_interactive": self.limits.reserved_interactive,
            "engine_hold_backlog": self.limits.hold_backlog,
            "engine_backlog_share": self.limits.backlog_share,
        }

    def live(self) -> dict[str, Any]:
        """The engine's rows now (the heartbeat; /readyz is set once and would show them frozen)."""
        engine = self.engine.engine
        return {
            "engine_rows_running": len(engine.running),
            "engine_rows_waiting": len(engine.waiting),
            # Backlog rows sitting out the steps while tickets decode, and the steps in a row the backlog
            # had work and none of its rows moved: a starved backlog shows here, not only in its silence.
            "engine_rows_held": len(engine.held),
            "engine_backlog_stalled_steps": engine.backlog_stalled,
        }

    def close(self) -> None:
        self.engine.stop()
        if self.streams is not None:
            self.streams.stop()

    def _progress(self, busy_s: float) -> None:
        self.engine_at = time.monotonic()
        if busy_s:
            with self._lock:
                self._busy_s += busy_s

    def run(self, slots: list[Slot]) -> None:
        """Decode each image in the pool, hand each job to the engine as soon as its inputs and its
        grammar are ready, and send each result off as its row finishes. A job whose grammar is still
        compiling waits beside the engine's rows, never in front of the jobs after it."""
        live = [s for s in slots if s.live]
        if not live:
            return
        with self._lock:
            if self._first_batch_at is None:
                self._first_batch_at = time.perf_counter()
        # Compiles start now, beside the decodes (workers/row_grammars.py).
        asks = [
            self.grammars.ask(
                slot.job.response_format if slot.job else None, slot.job.api_key if slot.job else None
            )
            for slot in live
        ]
        first: dict[tuple[str, ...], Future[Decoded]] = {}
        decodes = [(slot, ask, self.photos.soon(slot, first)) for slot, ask in zip(live, asks, strict=True)]
        del first  # its futures hold decoded images: only their own jobs may, until their inputs are built
        failed, ran = self._follow(decodes)
        self.metrics.busy_ratio.set(self.busy_ratio)
        if ran:
            errors = [s.error for s in failed if isinstance(s.error, ModelError)]
            self._watch_failures(len(failed) < ran, errors)
        self._finish(failed)

    def _prepare_ready(self, ready: list[tuple[Slot, Ask, Future[Decoded]]]) -> list[_Parked]:
        """The model inputs of jobs whose decode ended, in delivery order. Their futures hold decoded
        images: nothing here holds one past its row's inputs (this frame ends with them)."""
        prepared = []
        for slot, ask, future in ready:
            built = self._prepare(slot, future)
            if built is None:
                self.grammars.forget(ask)  # failed before it needed one: a queued compile may go
            else:
                prepared.append(_Parked(slot, ask, *built))
        return prepared

    def _prepare(self, slot: Slot, decoding: Future[tuple[Any, float]]) -> tuple[Any, int] | None:
        """The job's model inputs from its decoded image, or None (its error is set). What the result
        needs of the image (its size) is kept; the decoded tensor (on the device, ~120 MB at the pixel
        limit) and the fetched bytes are not: they would stay in memory until the delivery's last row."""
        decoded, seconds = decoding.result()
        slot.timings["preprocess"] += seconds * 1000
        if slot.encoded is not None:
            slot.encoded = slot.encoded.without_bytes()
        if isinstance(decoded, MrcError):
            slot.error = decoded
            return None
        slot.decoded_size = decoded.size
        built, seconds = stages.timed("preparing the model inputs", partial(self._inputs, slot, decoded))
        slot.timings["preprocess"] += seconds * 1000
        if isinstance(built, MrcError):
            slot.error = built
            return None
        return built

    def _inputs(self, slot: Slot, decoded: images.DecodedImage) -> tuple[Any, int]:
        assert slot.plan is not None
        assert slot.job is not None
        item = GenerationInput(
            decoded.tensor, slot.plan.text, slot.job.max_new_tokens, slot.plan.ids, pixels=decoded.pixels
        )
        inputs, positions = self.backend.row_inputs(item)
        return inputs, positions

    def _hand_over(
        self,
        parked: list[_Parked],
        rows: dict[Future[Row], Slot],
        grouped: list[tuple[Row, Slot]],
        watch: CancelWatch,
        decoded_all: bool = True,
    ) -> list[_Parked]:
        """Submit every parked job whose grammar is settled (suspects: together, once every one of the
        delivery is decoded and settled); a job whose grammar failed is settled (written with the
        delivery's end). The rest stay parked."""
        still = []
        for job in parked:
            settled = self.grammars.settle(job.ask)
            if isinstance(settled, float):
                job.wait_s = settled
                still.append(job)
            elif isinstance(settled, MrcError):
                job.slot.error = settled  # written with the delivery's end, as every failure is
            elif job.slot.group is not None:
                grouped.append((self._row(job, settled, watch), job.slot))
            else:
                rows[self.engine.submit(self._row(job, settled, watch))] = job.slot
        if grouped and decoded_all and not any(job.slot.group is not None for job in still):
            futures = self.engine.submit_many([row for row, _slot in grouped])
            rows.update(zip(futures, (slot for _row, slot in grouped), strict=True))
            grouped.clear()
        return still

    def _follow(self, decodes: list[tuple[Slot, Ask, Future[Decoded]]]) -> tuple[list[Slot], int]:
        """Take each job as its own decode ends (not behind a new photo earlier in the delivery), hand
        over parked jobs as their grammars settle, and take each row back as it finishes (its answer
        is written while the delivery's other photos still decode; its failure, with the delivery's
        end). Returns the model errors, to be written once the streak rule has judged them, and how
        many rows ran. Nothing outside this frame
        holds a job's decoded image or its built inputs (`decodes` is emptied in place)."""
        rows: dict[Future[Row], Slot] = {}
        parked: list[_Parked] = []
        # Suspects run as one group, so they go to the engine together once the delivery's last of them
        # is ready: a member handed in after the others had run would start the group's run again.
        grouped: list[tuple[Row, Slot]] = []
        failed: list[Slot] = []
        taken: set[Future[Row]] = set()
        watch = CancelWatch(self.admission.records)
        while decodes or parked or len(taken) < len(rows):
            watch.poll()
            running = set(rows) - taken
            compiling = {job.ask.future for job in parked if job.ask.future is not None}
            waits = [job.wait_s for job in parked] + [w for w in (watch.wait_s(),) if w is not None]
            timeout = min(waits, default=None)
            watched = running | compiling | {future for _slot, _ask, future in decodes}
            # Only the rows of what ended are kept: a decode's future holds its image until its inputs.
            finished = wait(watched, timeout=timeout, return_when=FIRST_COMPLETED).done & running
            del watched
            ended = [future.done() for _slot, _ask, future in decodes]  # read once: one may end now
            parked += self._prepare_ready([entry for entry, done in zip(decodes, ended, strict=True) if done])
            decodes[:] = [entry for entry, done in zip(decodes, ended, strict=True) if not done]  # run's too
            for future in finished:
                taken.add(future)
                slot = rows[future]
                self._take_row(slot, future.result())  # raises WorkerUnusable when the engine died
                # An answer is written now. A failure waits for the delivery's end (a model error, for
                # the streak rule too): should a fatal error give the delivery back unacked, a job
                # already requeued (out of memory) would run twice, and a failure be announced twice.
                if slot.error is None:
                    self._finish([slot])
                elif isinstance(slot.error, ModelError):
                    failed.append(slot)
            parked = self._hand_over(parked, rows, grouped, watch, decoded_all=not decodes)
        return failed, len(rows)

    def _row(self, job: _Parked, constraint: Any, watch: CancelWatch) -> Row:
        slot = job.slot
        assert slot.job is not None
        row = Row(
            self.engine.row_id(slot.job.job_id), job.inputs, job.positions, slot.job.max_new_tokens,
            self.backend.eos_id, lane=slot.job.lane, group=slot.group,
            deadline=self.admission.deadline_s(slot.job), constraint=constraint,
            identity=_identity(slot) if self.settings.engine_prefix_cache == "on" else None,
            stream_to=slot.job.job_id if slot.job.stream else None,
        )  # fmt: skip
        if slot.job.lane == "backlog":  # a run's job: its run may be cancelled while it waits
            watch.track(slot.job_id, row)
        return row

    def _take_row(self, slot: Slot, row: Row) -> None:
        """What the engine made of one job: its text, or its own error; the failure streak."""
        if row.first_admitted_at is not None:
            slot.admitted_at = row.first_admitted_at  # its wait in the queue ends at its first admission
        if row.first_token_at is not None:
            slot.first_token_at = row.first_token_at  # of the run that made its answer
        if row.admitted_at is not None and row.finished_at is not None:
            slot.timings["inference"] = (row.finished_at - row.admitted_at) * 1000
        slot.output_tokens = len(row.tokens)
        slot.prompt_positions = row.prompt_tokens
        slot.cached_positions = row.cached_tokens
        if row.error is not None:
            slot.error = row.error
            if isinstance(row.error, AnswerIncomplete):
                slot.text = self.backend.detokenize(row.tokens)  # what was generated, for the caller
            return
        assert slot.job is not None
        try:
            text = self.backend.detokenize(row.tokens)
            if slot.job.response_format is not None:
                slot.output = read_output(slot.job.response_format, text)
        except encoding.TooDeep as exc:  # a recursive schema's answer, deeper than anything reads back
            slot.error = InvalidJob(
                f"the answer is {exc}: answers are read back up to {encoding.MAX_DEPTH} levels; bound the "
                "schema's recursion (or give fewer max_new_tokens)"
            )
            return
        except Exception as exc:  # this row's failure alone, never its delivery's
            slot.error = InternalError(f"the answer cannot be read: {type(exc).__name__}: {str(exc)[:300]}")
            return
        slot.text = text
        slot.finish_reason = row.finish_reason
        slot.attention_path = "masked" if row.masked_steps else "causal"

    def _watch_failures(self, any_succeeded: bool, model_errors: list[ModelError]) -> None:
        """A model that fails job after job is the worker's fault, not the jobs': stop taking work
        (the delivery goes back to the queue) rather than fail every job in the lane. Counted per
        delivery: failures beside a success in the same delivery were their jobs'."""
        with self._lock:
            if any_succeeded:
                self._failure_streak = 0
                return
            self._failure_streak += len(model_errors)
            streak = self._failure_streak
        if model_errors and streak >= self.settings.model_failure_streak:
            raise WorkerUnusable(f"the model failed {streak} jobs in a row; last: {model_errors[-1].message}")


def _identity(slot: Slot) -> tuple[str, str, int, int] | None:
    """What decides the job's prefix besides its token ids: the key that sent it (one tenant never
    learns by a faster answer that another asked about the same photo), the image's bytes and the size
    they decoded to (what they are fitted to then depends on the worker's settings alone). None: no
    image to share a prefix with."""
    if slot.encoded is None or not slot.encoded.sha256 or slot.decoded_size is None or slot.job is None:
        return None
    size = slot.decoded_size
    return tenants.owner_of(slot.job.job_id) or "", slot.encoded.sha256, size.width, size.height
