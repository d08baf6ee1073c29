"""The model stage of a delivery over the echo model (issue 36): a grammar that compiles slowly holds
neither the jobs beside it nor a second compile of itself (item 9), and a job keeps nothing of its
decoded image but its size once its model inputs are built, nor its inputs once its row is done
(item 10). States and counts only: the slow compile is a stand-in the test holds and releases."""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import CancelledError, Future, wait
from typing import Any, cast

import pytest
import torch

from shared import response_format as rf
from shared.jobs import Job
from shared.memory_records import MemoryJobRecords
from shared.settings import Settings
from shared.stores.memory import MemoryStore
from tests.support import imagegen
from workers import images, photos
from workers.backends.base import GenerationInput
from workers.backends.echo import EchoBackend, EchoRows, EchoSteps
from workers.pipeline import Pipeline, assemble
from workers.slots import Message, Slot

GUARD_S = 15.0  # how long a held compile or a wait for results lasts at most, should the test fail
ANSWER = "64x48: refund?"  # the echo model's answer to the prompt "refund?" about a 64x48 photo


@pytest.fixture
def store() -> MemoryStore:
    s = MemoryStore("mrc")
    s.put_bytes("inputs/good.jpg", imagegen.photo(64, 48), "image/jpeg")
    return s


def _job(job_id: str, prompt: str = "refund?", **fields: Any) -> Message:
    body = {"job_id": job_id, "image_uri": "s3://mrc/inputs/good.jpg", "prompt": prompt, "max_new_tokens": 8}
    return Message(job_id, {**body, **fields})


def _pipeline(store: MemoryStore, backend: EchoBackend, **settings: Any) -> Pipeline:
    return assemble(backend, store, store, MemoryJobRecords(), Settings(**settings), sleep=lambda _s: None)


# ------------------------------------------------------------------ item 9: a slow grammar compile
class HeldGrammars:
    """The backend's grammars with a compile the test holds: any format holding the choice "slow".
    A compiled grammar is a free row here (the echo model applies no mask)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.returned = threading.Event()  # the held compile has ended
        self.compiles: list[str] = []
        self.kept: dict[str, str] = {}

    def cached(self, fmt: Any, owner: str = "") -> Any:
        return self.kept.get(rf.digest(fmt))

    def compile_and_keep(self, fmt: Any, owner: str = "") -> tuple[Any, float]:
        self.compiles.append(rf.canonical(fmt))
        if "slow" in rf.canonical(fmt):
            self.release.wait(GUARD_S)
        self.kept[rf.digest(fmt)] = "grammar"
        if "slow" in rf.canonical(fmt):
            self.returned.set()  # kept first: the next job of the format finds it
        return "grammar", 0.0

    def matcher(self, compiled: Any) -> Any:
        return None

    def constraint(self, fmt: Any) -> tuple[Any, float | None]:  # the interface before issue 36
        if self.cached(fmt) is not None:
            return None, None
        return None, self.compile_and_keep(fmt)[1]


def _written(store: MemoryStore) -> set[str]:
    return {
        key.removeprefix("results/").removesuffix(".json") for _b, key in store.objects if "results/" in key
    }


def _code(store: MemoryStore, job_id: str) -> str | None:
    result = store.get_result(job_id)
    assert result is not None, job_id
    return result["error"]["code"] if result["error"] else None


def test_a_slow_grammar_holds_neither_the_jobs_beside_it_nor_a_second_compile(store: MemoryStore) -> None:
    backend = EchoBackend()
    grammars = HeldGrammars()
    backend.grammars = grammars  # type: ignore[assignment]
    pipeline = _pipeline(store, backend, grammar_compile_timeout_s=0.2)
    slow = {"type": "choice", "choices": [ANSWER, "slow"]}
    quick = {"type": "choice", "choices": [ANSWER, "quick"]}
    first = [_job("held", response_format=slow), _job("free"), _job("quick", response_format=quick)]
    delivery = threading.Thread(target=pipeline.run, args=(first,), daemon=True)
    delivery.start()
    try:
        while not {"held", "free", "quick"} <= _written(store) and not grammars.returned.wait(0.05):
            pass
        # Every result of the delivery is written while the held compile still runs.
        assert not grammars.returned.is_set()
        assert {"held", "free", "quick"} <= _written(store)
        assert (_code(store, "free"), _code(store, "quick")) == (None, None)
        assert store.get_result("quick")["output"] == ANSWER
        held = store.get_result("held")
        assert held["error"]["code"] == "invalid_job"
        assert held["error"]["message"].startswith("response_format.choices: its grammar did not compile")
        assert "MRC_GRAMMAR_COMPILE_TIMEOUT_S" in held["error"]["message"]
        # A later job of the same format fails at once: the compile still runs, none is started again.
        assert pipeline.run([_job("held-again", response_format=slow)]) == ["failed"]
        assert _code(store, "held-again") == "invalid_job"
        assert sum("slow" in c for c in grammars.compiles) == 1
    finally:
        grammars.release.set()
        delivery.join(GUARD_S)
    assert grammars.returned.wait(GUARD_S)
    # Once it ends, its grammar is kept: the format's next job runs without compiling it again.
    assert pipeline.run([_job("held-later", response_format=slow)]) == ["succeeded"]
    assert sum("slow" in c for c in grammars.compiles) == 1


# ------------------------------------------------------------------ item 10: what a job keeps
class Watched(EchoBackend):
    """The echo model, watching what stays alive: at every decode step, a running row's decoded image
    must be gone (its inputs are built), and so must the inputs of every row that has finished. No
    garbage collection is forced: freed means freed at once, by reference counting (a GPU tensor
    held until the collector runs holds its device memory as long)."""

    def __init__(self) -> None:
        super().__init__(token_s=0.001)  # paced: every answer takes its whole max_new_tokens
        self.images: dict[str, weakref.ref[torch.Tensor]] = {}
        self.inputs: dict[str, weakref.ref[GenerationInput]] = {}
        self.seen: set[str] = set()  # prompts of rows that have run
        self.alive: list[tuple[str, str]] = []
        self.steps = 0

    def row_inputs(self, item: GenerationInput) -> tuple[Any, int]:
        """Inputs that are not the image (as a real model's patches are not): a view of the same shape
        over three bytes."""
        height, width = item.image.shape[-2:]
        self.images[item.prompt] = weakref.ref(item.image)
        shaped = torch.zeros((3, 1, 1), dtype=torch.uint8).expand(3, height, width)
        inputs = GenerationInput(shaped, item.prompt, item.max_new_tokens, item.prompt_ids)
        self.inputs[item.prompt] = weakref.ref(inputs)
        return inputs, self.image_tokens(height, width) + len(item.prompt.split())

    def step_model(
        self, slots: int = 2, positions: int | None = None, pool: int | None = None, decode: str | None = None
    ) -> EchoSteps:
        return WatchedSteps(self)


class WatchedSteps(EchoSteps):
    backend: Watched

    def decode(self, batch: EchoRows, last_tokens: list[int], masks: Any = None) -> list[int]:
        watched = self.backend
        running = {batch.scripts[row_id][1].prompt for row_id in batch.row_ids}
        watched.steps += 1
        watched.alive += [("image", p) for p in running if watched.images[p]() is not None]
        finished = watched.seen - running  # no row is paused here: a row gone from the batch is done
        watched.alive += [("inputs", p) for p in finished if watched.inputs[p]() is not None]
        watched.seen |= running
        return super().decode(batch, last_tokens, masks)


@pytest.mark.parametrize("kept_mb", [0, 1], ids=["none-kept", "kept-for-the-next-question"])
def test_a_job_keeps_its_images_size_not_its_pixels_nor_its_finished_inputs(
    store: MemoryStore, kept_mb: int
) -> None:
    """Without decoded photos kept (MRC_DECODED_IMAGE_CACHE_MB=0) nothing of the pixels outlives the
    row's inputs; with them, the one decoded photo is the cache's, counted in its budget, and the
    finished rows' inputs are freed all the same."""
    backend = Watched()
    pipeline = _pipeline(store, backend, decoded_image_cache_mb=kept_mb)
    messages = [
        _job("short", prompt="short one", max_new_tokens=2),
        _job("long", prompt="long one", max_new_tokens=12),
    ]
    assert pipeline.run(messages) == ["succeeded", "succeeded"]
    assert backend.steps >= 10  # the long row decoded on long after the short one finished
    held = pipeline.model.photos.decoded.held
    if kept_mb:
        assert {what for what, _prompt in backend.alive} == {"image"}
        assert held == 3 * 64 * 48  # the photo both jobs asked about, decoded once and kept
    else:
        assert backend.alive == []
        assert held == 0
    for job_id in ("short", "long"):
        image = store.get_result(job_id)["image"]
        assert (image["width"], image["height"]) == (64, 48)
        assert image["sha256"]


# ------------------------------------------------------------------ a photo decoding holds no one else
class HeldDecode(EchoBackend):
    """The echo model, decoding as a model would, with the fitting of one photo (by its width) held by
    the test until it lets go."""

    def __init__(self, held_width: int) -> None:
        super().__init__()
        self.held_width = held_width
        self.holding, self.release = threading.Event(), threading.Event()
        self.fitted: list[int] = []  # the width of every photo fitted (decoded), in order

    def fit_image(self, image: Any) -> Any:
        width = int(image.shape[-1])
        self.fitted.append(width)
        if width == self.held_width:
            self.holding.set()
            self.release.wait(GUARD_S)
        return image


def _run_holding(
    store: MemoryStore,
    pipeline: Pipeline,
    backend: HeldDecode,
    delivery: list[Message],
    answered: set[str],
    waiting: set[str],
) -> list[list[str]]:
    """Run the delivery while the backend holds its photo's decode: `answered` are written meanwhile,
    `waiting` are not; then let go. The delivery's outcomes."""
    outcomes: list[list[str]] = []
    running = threading.Thread(target=lambda: outcomes.append(pipeline.run(delivery)), daemon=True)
    running.start()
    try:
        assert backend.holding.wait(GUARD_S)
        deadline = time.monotonic() + GUARD_S
        while not answered <= _written(store) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert answered <= _written(store)  # answered while the held decode runs
        assert not waiting & _written(store)
    finally:
        backend.release.set()
        running.join(GUARD_S)
    return outcomes


def test_jobs_go_to_the_engine_as_their_own_photo_is_ready_and_waiting_holds_no_decode_thread(
    store: MemoryStore,
) -> None:
    """A delivery of a new photo's two questions (its decode held), a photo already kept and another
    new photo, with two decode threads: the kept photo's job and the other photo's are answered while
    the held decode still runs (neither waits behind it in the delivery's order, and the second
    question of the held photo waits for its decode without a thread); the held photo is decoded once."""
    store.put_bytes("inputs/held.jpg", imagegen.photo(80, 60), "image/jpeg")
    store.put_bytes("inputs/other.jpg", imagegen.photo(96, 72), "image/jpeg")
    backend = HeldDecode(held_width=80)
    pipeline = _pipeline(store, backend, fetch_threads=2)
    try:
        assert pipeline.run([_job("keep")]) == ["succeeded"]  # good.jpg is kept from here on
        delivery = [
            _job("held-1", image_uri="s3://mrc/inputs/held.jpg"),
            _job("held-2", image_uri="s3://mrc/inputs/held.jpg"),
            _job("kept"),
            _job("other", image_uri="s3://mrc/inputs/other.jpg"),
        ]
        outcomes = _run_holding(store, pipeline, backend, delivery, {"kept", "other"}, {"held-1", "held-2"})
        assert outcomes == [["succeeded"] * 4]
        assert (backend.fitted.count(80), backend.fitted.count(64)) == (1, 1)  # each photo decoded once
        count = pipeline.metrics.registry.get_sample_value
        assert count("mrc_image_decodes_total", {"result": "reused"}) == 2  # held-2 and kept
        for job_id in ("held-1", "held-2"):
            assert store.get_result(job_id)["text"].startswith("80x60"), job_id
        # The second question waited for the held decode as long as the first: its preprocessing says so.
        decoding, waiting = (store.get_result(j)["timings_ms"]["preprocess"] for j in ("held-1", "held-2"))
        assert waiting >= 0.5 * decoding, (waiting, decoding)
    finally:
        pipeline.close()


def test_a_ticket_never_waits_for_a_backlog_decode_queued_in_its_delivery(store: MemoryStore) -> None:
    """A delivery with a backlog job's new photo ahead of a ticket's question about the same photo, the
    backlog's one decode thread held by another photo: the ticket's photo is decoded on the tickets'
    threads and answered meanwhile (it is not handed the backlog job's decode, queued behind the held
    one), and the backlog job is answered once the hold ends."""
    store.put_bytes("inputs/held.jpg", imagegen.photo(80, 60), "image/jpeg")
    store.put_bytes("inputs/both.jpg", imagegen.photo(96, 72), "image/jpeg")
    backend = HeldDecode(held_width=80)
    pipeline = _pipeline(store, backend, fetch_threads=1)
    try:
        delivery = [
            _job("bl-held", image_uri="s3://mrc/inputs/held.jpg", lane="backlog"),
            _job("bl-both", image_uri="s3://mrc/inputs/both.jpg", lane="backlog"),
            _job("ticket", image_uri="s3://mrc/inputs/both.jpg"),
        ]
        outcomes = _run_holding(store, pipeline, backend, delivery, {"ticket"}, {"bl-held", "bl-both"})
        assert outcomes == [["succeeded"] * 3]
        assert store.get_result("bl-both")["text"] == store.get_result("ticket")["text"]
    finally:
        pipeline.close()


def test_a_job_sharing_a_decode_the_pool_cancelled_at_shutdown_is_not_left_waiting(
    store: MemoryStore,
) -> None:
    """A shared decode, or a job's own retry after one failed, cancelled by the pool's shutdown: the
    waiting job's decode ends (cancelled, as an unshared job's would), so the delivery never waits on
    it forever."""
    pipeline = _pipeline(store, EchoBackend())
    try:
        cancelled: Future[Any] = Future()
        cancelled.cancel()
        shared_out: Future[Any] = Future()
        pipeline.model.photos.take_shared(cast(Any, None), shared_out, cancelled)
        retry_out: Future[Any] = Future()
        photos.forward(retry_out, cancelled)
        assert not wait([shared_out, retry_out], timeout=GUARD_S).not_done
        for out in (shared_out, retry_out):
            with pytest.raises(CancelledError):
                out.result()
    finally:
        pipeline.close()


def test_a_finished_rows_result_is_not_written_behind_its_lanes_held_decode(store: MemoryStore) -> None:
    """One decode thread, held by a new photo's decode: a kept photo's question in the same delivery
    is answered and its result written meanwhile (writes have threads of their own; on the decode
    pool the write queued behind the held decode)."""
    store.put_bytes("inputs/held.jpg", imagegen.photo(80, 60), "image/jpeg")
    backend = HeldDecode(held_width=80)
    pipeline = _pipeline(store, backend, fetch_threads=1)
    try:
        assert pipeline.run([_job("keep")]) == ["succeeded"]  # good.jpg is kept from here on
        delivery = [_job("held", image_uri="s3://mrc/inputs/held.jpg"), _job("kept")]
        outcomes = _run_holding(store, pipeline, backend, delivery, {"kept"}, {"held"})
        assert outcomes == [["succeeded"] * 2]
    finally:
        pipeline.close()


def test_a_decode_thread_finding_its_photo_decoding_for_another_lane_goes_back_to_the_pool(
    store: MemoryStore,
) -> None:
    """A ticket handed over before a backlog job's decode of the same photo began (that decode was
    queued behind the backlog's others), whose thread runs once it has begun: the thread does not
    wait for it (the tickets' other photos would wait for the thread); the ticket takes that decode's
    image when it ends."""
    store.put_bytes("inputs/held.jpg", imagegen.photo(80, 60), "image/jpeg")
    backend = HeldDecode(held_width=80)
    pipeline = _pipeline(store, backend, fetch_threads=1)
    backlog = threading.Thread(
        target=pipeline.run, args=([_job("bl", image_uri="s3://mrc/inputs/held.jpg", lane="backlog")],)
    )
    try:
        backlog.start()
        assert backend.holding.wait(GUARD_S)  # the backlog's decode of the photo runs, held
        ticket = Slot("t", {}, time.time())
        ticket.job = Job.from_message(
            {"job_id": "t", "image_uri": "s3://mrc/inputs/held.jpg", "prompt": "a?", "max_new_tokens": 4}
        )
        ticket.encoded = images.inspect(store.get_bytes("mrc", "inputs/held.jpg", 10**7) or b"", 10**8)
        out: Future[Any] = Future()
        thread = threading.Thread(target=pipeline.model.photos._decode_into, args=(ticket, out))
        thread.start()
        thread.join(GUARD_S / 3)
        assert not thread.is_alive()  # back to the pool at once
        assert not out.done()
        backend.release.set()
        image, _seconds = out.result(GUARD_S)
        assert (image.width, image.height) == (80, 60)
        assert backend.fitted.count(80) == 1  # decoded once, for both
    finally:
        backend.release.set()
        backlog.join(GUARD_S)
        pipeline.close()


@pytest.mark.parametrize("kept_mb", [0, 256], ids=["none-kept", "kept"])
def test_a_pool_shut_down_under_a_queued_decode_ends_its_sharers_and_returns(
    store: MemoryStore, kept_mb: int
) -> None:
    """One backlog decode thread, held; a photo's decode queued behind it and two jobs sharing that
    queued decode (or, keeping nothing, each decoding its own); the pool shut down: the shutdown
    returns, and every job's decode ends (cancelled) as `wait` sees it. The sharers' callbacks ran
    inside the shutdown, which held the pool's lock: a sharer that tried its own decode there waited
    for that lock forever; and the pool's own future, cancelled by the shutdown, is never done for
    `wait` (a review helper's finds)."""
    store.put_bytes("inputs/held.jpg", imagegen.photo(80, 60), "image/jpeg")
    store.put_bytes("inputs/queued.jpg", imagegen.photo(96, 72), "image/jpeg")
    backend = HeldDecode(held_width=80)
    pipeline = _pipeline(store, backend, fetch_threads=1, decoded_image_cache_mb=kept_mb)
    photos = pipeline.model.photos

    def slot(job_id: str, name: str) -> Slot:
        made = Slot(job_id, {}, time.time())
        uri = f"s3://mrc/inputs/{name}"
        made.job = Job.from_message(
            {"job_id": job_id, "image_uri": uri, "prompt": "a?", "max_new_tokens": 4, "lane": "backlog"}
        )
        made.encoded = images.inspect(store.get_bytes("mrc", f"inputs/{name}", 10**7) or b"", 10**8)
        return made

    first: dict[tuple[str, ...], Future[Any]] = {}
    try:
        held = photos.soon(slot("held", "held.jpg"), first)
        assert backend.holding.wait(GUARD_S)
        queued = [photos.soon(slot(f"q{n}", "queued.jpg"), first) for n in range(3)]
        closing = threading.Thread(target=pipeline.close, daemon=True)
        closing.start()
        closing.join(GUARD_S / 3)
        assert not closing.is_alive()
        backend.release.set()
        assert not wait([held, *queued], timeout=GUARD_S).not_done
        for future in queued:
            with pytest.raises(CancelledError):
                future.result()
    finally:
        backend.release.set()


def test_answers_from_the_cache_are_written_before_the_deliverys_rows_end_and_failures_are_not(
    store: MemoryStore,
) -> None:
    """A delivery with a new photo (its decode held), a question answered from the cache and a job
    whose image is missing: the cached answer is written while the held job still waits (it was
    written after the delivery's last row: a ticket beside backlog rows waited for it, found by the
    lanes test on a slow machine). The failure is not: it is written with the delivery's end, in case
    a fatal error gives the delivery back (test_pipeline: nothing of it is written or requeued)."""
    from workers.memory_cache import MemoryResultCache

    store.put_bytes("inputs/held.jpg", imagegen.photo(80, 60), "image/jpeg")
    backend = HeldDecode(held_width=80)
    pipeline = assemble(
        backend,
        store,
        store,
        MemoryJobRecords(),
        Settings(),
        sleep=lambda _s: None,
        cache=MemoryResultCache(),
    )
    try:
        assert pipeline.run([_job("asked-before")]) == ["succeeded"]  # its answer is cached from here on
        delivery = [
            _job("held", image_uri="s3://mrc/inputs/held.jpg"),
            _job("cached"),
            _job("missing", image_uri="s3://mrc/inputs/gone.jpg"),
        ]
        outcomes = _run_holding(store, pipeline, backend, delivery, {"cached"}, {"held", "missing"})
        assert outcomes == [["succeeded", "succeeded", "failed"]]
        assert store.get_result("cached")["cache_hit"] is True
        assert _code(store, "missing") == "image_not_found"
    finally:
        pipeline.close()


def test_a_delivery_whose_photo_is_ready_after_the_worker_closed_ends_instead_of_waiting(
    store: MemoryStore,
) -> None:
    """Found by review: a delivery whose decode was still running when close() stopped the engine
    handed its row to an engine loop that had ended; the row's future never completed and the
    delivery waited for ever. Now the row fails at once (WorkerUnusable: the delivery is given back)."""
    from shared.errors import WorkerUnusable

    store.put_bytes("inputs/held.jpg", imagegen.photo(80, 60), "image/jpeg")
    backend = HeldDecode(held_width=80)
    pipeline = _pipeline(store, backend, fetch_threads=1)
    ended: list[BaseException | list[str]] = []

    def deliver() -> None:
        try:
            ended.append(pipeline.run([_job("held", image_uri="s3://mrc/inputs/held.jpg")]))
        except BaseException as exc:  # what the delivery ended with is the finding
            ended.append(exc)

    running = threading.Thread(target=deliver, daemon=True)
    running.start()
    assert backend.holding.wait(GUARD_S)
    closing = threading.Thread(target=pipeline.close, daemon=True)
    closing.start()
    closing.join(GUARD_S)
    assert not closing.is_alive()
    backend.release.set()
    running.join(GUARD_S)
    assert not running.is_alive(), "the delivery waits for an engine that has stopped"
    assert len(ended) == 1
    assert isinstance(ended[0], WorkerUnusable)
    assert "held" not in _written(store)  # given back, not failed: another worker runs it


class _FaultySteps(EchoSteps):
    """Echo's engine steps: a row asking "oom?" runs out of memory (alone too: a retry), a row asking
    "refund?" breaks the device."""

    def _maybe_fail(self, items: list[Any]) -> None:
        if any("oom" in item.prompt for item in items):
            raise MemoryError("out of memory")
        if any("refund" in item.prompt for item in items):
            raise RuntimeError("CUDA error: an illegal memory access")


class _HeldFaulty(HeldDecode):
    def step_model(self, *args: Any, **kwargs: Any) -> EchoSteps:
        return _FaultySteps(self)


def test_a_failure_in_the_model_waits_for_the_deliverys_end_so_a_fatal_error_leaves_no_retry_copy(
    store: MemoryStore,
) -> None:
    """Found by review of 87ac55a: a row that failed in the model for another reason than a model
    error (out of memory, its deadline, its grammar) was written at once; out of memory is retried,
    so its countdown copy was queued. A device fault on the delivery's next row then gave the delivery
    back unacked: the job was queued twice and ran twice. Its failure now waits for the delivery's end,
    which the fault never reaches."""
    from shared.errors import WorkerUnusable

    store.put_bytes("inputs/held.jpg", imagegen.photo(80, 60), "image/jpeg")
    requeued: list[str] = []
    backend = _HeldFaulty(held_width=80)
    pipeline = assemble(
        backend, store, store, MemoryJobRecords(), Settings(fetch_threads=2), sleep=lambda _s: None,
        requeue=lambda request_id, _body, _delay: requeued.append(request_id),
    )  # fmt: skip
    delivery = [_job("oom", prompt="oom?"), _job("fatal", image_uri="s3://mrc/inputs/held.jpg")]
    ended: list[BaseException | list[str]] = []

    def deliver() -> None:
        try:
            ended.append(pipeline.run(delivery))
        except BaseException as exc:  # what the delivery ended with is the finding
            ended.append(exc)

    running = threading.Thread(target=deliver, daemon=True)
    running.start()
    try:
        assert backend.holding.wait(GUARD_S)
        deadline = time.monotonic() + GUARD_S  # the "oom" row runs (and fails) while the photo is held
        while "oom?" not in backend.prefills and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # what the old code did with the failed row, it did at once
    finally:
        backend.release.set()
    running.join(GUARD_S)
    pipeline.close()
    assert len(ended) == 1
    assert isinstance(ended[0], WorkerUnusable)
    assert requeued == []
    assert not _written(store)


def test_a_backlog_job_whose_run_is_cancelled_while_it_waits_for_the_engine_is_not_run(
    store: MemoryStore,
) -> None:
    """Review: a cancel came while a delivery's backlog jobs waited for the one row the engine runs at
    once; it answered 0 and they ran. The rows not yet admitted are read again once a second."""
    records = MemoryJobRecords()
    backend = EchoBackend(token_s=0.25)
    settings = Settings(model_batch_max_jobs=1, engine_reserved_rows=0)
    pipeline = assemble(backend, store, store, records, settings, sleep=lambda _s: None)
    lanes = {"lane": "backlog"}

    def cancel_when_running() -> None:
        deadline = time.monotonic() + GUARD_S
        while records.get("first").get("state") != "running" and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the first is decoding; the second waits for its turn
        records.records["second"]["cancelled"] = "1"

    canceller = threading.Thread(target=cancel_when_running)
    canceller.start()
    try:
        outcomes = pipeline.run([_job("first", **lanes), _job("second", **lanes)])
    finally:
        canceller.join()
        pipeline.close()
    assert outcomes == ["succeeded", "failed"]
    assert store.get_result("second")["error"]["code"] == "cancelled"
