"""The iteration-level engine (workers/engine/): its oracle and its scheduling policy.

The oracle: every row's tokens equal the same job through `generate()` alone (greedy, fp32, CPU),
whatever the arrival schedule, the image sizes, the prompt lengths and the `max_new_tokens` of the
rows it shares steps with: rows join the running batch mid-flight and leave at their own length.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.settings import Settings
from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend
from workers.engine import scheduler
from workers.engine.engine import Engine
from workers.engine.runner import Runner
from workers.engine.sequence import Sequence

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")
SIZES = [(48, 64), (90, 120), (200, 150), (240, 320)]
PROMPTS = ["Refund?", "Is the parcel damaged at all, or only the box?", "What is written on the label here?"]


@pytest.fixture(scope="module")
def backend() -> FuyuBackend:
    loaded = FuyuBackend(Settings(model="tiny", home=HOME, quantization="fp32", device="cpu"))
    loaded.load()
    return loaded


def _item(size: int, prompt: int, new: int) -> GenerationInput:
    height, width = SIZES[size]
    fill = 40 + 50 * size + 7 * prompt  # a different picture per size and prompt
    image = torch.full((3, height, width), fill, dtype=torch.uint8)
    image[:, : height // 2] = 255 - fill
    return GenerationInput(image, PROMPTS[prompt], new)


def _alone(backend: FuyuBackend, item: GenerationInput) -> list[int]:
    """The reference: the job through generate() by itself, cut at end-of-text."""
    prepared = backend.prepare([item])
    with torch.inference_mode():
        out = backend.model.generate(
            **prepared.inputs, max_new_tokens=item.max_new_tokens, do_sample=False,
            pad_token_id=backend.token_ids.pad, eos_token_id=backend.eos_id,
        )  # fmt: skip
    row = out[0, prepared.inputs["input_ids"].shape[1] :].tolist()
    return row[: row.index(backend.eos_id)] if backend.eos_id in row else row


def _sequence(backend: FuyuBackend, row_id: str, item: GenerationInput, lane: str) -> Sequence:
    inputs = backend.prepare([item]).inputs
    return Sequence(
        row_id, inputs, int(inputs["input_ids"].shape[1]), item.max_new_tokens, backend.eos_id, lane
    )


def _run(
    backend: FuyuBackend, jobs: list[tuple[GenerationInput, int, str]], limits: scheduler.Limits
) -> tuple[dict[str, Sequence], Engine]:
    """Submit each job at its arrival step; run until every row has finished."""
    done: dict[str, Sequence] = {}
    engine = Engine(Runner(backend.model), limits, lambda row: done.__setitem__(row.row_id, row))
    pending = sorted(range(len(jobs)), key=lambda i: jobs[i][1])
    while pending or not engine.idle:
        while pending and jobs[pending[0]][1] <= engine.steps:
            index = pending.pop(0)
            item, _arrival, lane = jobs[index]
            engine.submit(_sequence(backend, str(index), item, lane))
        engine.step()
        assert engine.steps < 500, "the engine does not finish"
    return done, engine


job = st.tuples(
    st.integers(0, len(SIZES) - 1), st.integers(0, len(PROMPTS) - 1), st.integers(1, 10),
    st.integers(0, 6), st.sampled_from(["interactive", "backlog"]),
)  # fmt: skip


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.lists(job, min_size=1, max_size=4), st.integers(1, 4))
def test_every_row_equals_the_same_job_alone(backend: FuyuBackend, spec: list[Any], rows: int) -> None:
    reference = cache(lambda size, prompt, new: tuple(_alone(backend, _item(size, prompt, new))))
    jobs = [(_item(size, prompt, new), arrival, lane) for size, prompt, new, arrival, lane in spec]
    done, _engine = _run(
        backend, jobs, scheduler.Limits(max_rows=rows, kv_tokens=1 << 20, reserved_interactive=0)
    )
    assert sorted(done) == [str(i) for i in range(len(jobs))]
    for index, (size, prompt, new, _arrival, _lane) in enumerate(spec):
        row = done[str(index)]
        assert row.tokens == list(reference(size, prompt, new)), f"row {index} of {spec}"
        assert row.finish_reason == ("length" if len(row.tokens) == new else "stop")


def test_a_row_joins_mid_flight_and_leaves_at_its_own_length(backend: FuyuBackend) -> None:
    """A long row runs; a short one joins at step 3 and leaves before it; a third joins after."""
    long, short, late = _item(3, 1, 12), _item(0, 0, 3), _item(1, 2, 5)
    jobs = [(long, 0, "backlog"), (short, 3, "interactive"), (late, 5, "interactive")]
    done, engine = _run(backend, jobs, scheduler.Limits(max_rows=4, kv_tokens=1 << 20))
    for index, (item, _arrival, _lane) in enumerate(jobs):
        assert done[str(index)].tokens == _alone(backend, item)
    assert engine.steps < 12 + 2, "the rows did not share steps"


# ------------------------------------------------------------------ the policy (no model)
def _c(row_id: str, lane: str = "interactive", tokens: int = 100) -> scheduler.Candidate:
    return scheduler.Candidate(row_id, lane, tokens)


def test_interactive_rows_are_admitted_before_backlog_rows_whatever_came_first() -> None:
    waiting = [_c("b1", "backlog"), _c("i1"), _c("b2", "backlog"), _c("i2")]
    limits = scheduler.Limits(max_rows=3, kv_tokens=10_000, reserved_interactive=0)
    assert scheduler.admit(waiting, [], limits) == ["i1", "i2", "b1"]


def test_slots_kept_for_tickets_are_never_taken_by_backlog_rows() -> None:
    limits = scheduler.Limits(max_rows=4, kv_tokens=10_000, reserved_interactive=1)
    running = [_c(f"b{i}", "backlog") for i in range(3)]
    assert scheduler.admit([_c("b9", "backlog")], running, limits) == []
    assert scheduler.admit([_c("b9", "backlog"), _c("t1")], running, limits) == ["t1"]


def test_a_row_is_admitted_only_if_every_running_row_still_fits_at_its_longest() -> None:
    limits = scheduler.Limits(max_rows=8, kv_tokens=1_000, reserved_interactive=0)
    running = [_c("r1", tokens=600)]
    assert scheduler.admit([_c("big", tokens=500), _c("small", tokens=300)], running, limits) == ["small"]


def test_a_row_too_large_for_the_cache_runs_when_nothing_else_does() -> None:
    limits = scheduler.Limits(max_rows=8, kv_tokens=1_000, reserved_interactive=0)
    assert scheduler.admit([_c("huge", tokens=5_000)], [], limits) == ["huge"]
    assert scheduler.admit([_c("huge", tokens=5_000)], [_c("r1")], limits) == []
