"""Structured answers: the producer's checks of a response_format, and the worker's grammar on the
engine (tiny Fuyu, random weights: its free text is noise, so only the grammar makes an answer parse).

The oracle of the engine extends to constrained rows: a constrained row alone equals the same row in
any batch, and free rows beside constrained ones stay byte-identical to their unconstrained run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import response_format as rf
from shared.errors import AnswerIncomplete, InvalidJob
from shared.jobs import Job, limit_problem
from shared.settings import Settings
from tests.support import schema_draws
from tests.support.refund import REFUND_SCHEMA
from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend
from workers.engine import masks, scheduler
from workers.engine.engine import Engine
from workers.engine.sequence import Sequence
from workers.grammar import Grammars

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")
DRAFT7 = "http://json-schema.org/draft-07/schema#"
MESSAGE = {"job_id": "j1", "image_uri": "s3://mrc/a.jpg", "prompt": "Refund?", "max_new_tokens": 8}
REFUND = REFUND_SCHEMA


@pytest.fixture(scope="module")
def backend() -> FuyuBackend:
    loaded = FuyuBackend(Settings(model="tiny", home=HOME, quantization="fp32", device="cpu"))
    loaded.load()
    return loaded


# ------------------------------------------------------------------ the producer's checks (no torch)
@pytest.mark.parametrize(
    ("fmt", "reason"),
    [
        ({"type": "choice", "choices": []}, "the list is empty"),
        ({"type": "choice", "choices": ["refund", "refund"]}, "listed twice"),
        ({"type": "choice", "choices": ["refund", ""]}, "empty string"),
        ({"type": "choice", "choices": ["a\nb"]}, "control character"),
        ({"type": "choice", "choices": "refund"}, "list"),
        ({"type": "json_schema", "schema": {"type": "strng"}}, "not valid JSON Schema at /type"),
        ({"type": "json_schema", "schema": {"minLength": -1}}, "not valid JSON Schema"),
        ({"type": "json_schema", "schema": {"oneOf": [{"type": "integer"}]}}, "'oneOf' is not enforced"),
        ({"type": "json_schema", "schema": {"items": {"uniqueItems": True}}}, "/items/uniqueItems"),
        ({"type": "json_schema", "schema": {"not": {"type": "null"}}}, "'not' is not enforced"),
        ({"type": "json_schema", "schema": {"type": "string", "format": "date"}}, "'format' is not enforced"),
        ({"type": "json_schema", "schema": {"type": "integer", "multipleOf": 2}}, "'multipleOf'"),
        ({"type": "json_schema", "schema": {"$ref": "https://example.com/s.json"}}, "never fetched"),
        ({"type": "json_schema", "schema": {"required": ["refund"]}}, "not in properties"),
        (
            {"type": "json_schema", "schema": {"$schema": DRAFT7, "items": [{"type": "integer"}]}},
            "prefixItems",
        ),
        ({"type": "json_schema", "schema": []}, "dict"),
        ({"type": "json_schema"}, "schema"),
        ({"type": "regex", "pattern": "a+"}, "does not match any of the expected tags"),
    ],
)
def test_formats_the_decoder_cannot_enforce_are_refused_with_their_reason(fmt: Any, reason: str) -> None:
    with pytest.raises(ValueError, match="response_format") as refused:
        rf.parse(fmt)
    assert reason in str(refused.value)
    with pytest.raises(InvalidJob, match="response_format"):
        Job.from_message({**MESSAGE, "response_format": fmt})


def test_the_deployment_limits_size_and_choices() -> None:
    settings = Settings(max_response_format_bytes=200, max_choices=3)
    many = rf.parse({"type": "choice", "choices": ["a", "b", "c", "d"]})
    assert "4 choices; the limit is 3" in str(limit_problem(settings, "Refund?", response_format=many))
    big = rf.parse({"type": "json_schema", "schema": {"enum": ["x" * 300]}})
    assert "the limit is 200" in str(limit_problem(settings, "Refund?", response_format=big))
    assert (
        limit_problem(settings, "Refund?", response_format=rf.parse({"type": "choice", "choices": ["a"]}))
        is None
    )


def test_a_job_carries_its_format_and_its_fingerprint_covers_it() -> None:
    free = Job.from_message(MESSAGE)
    assert "response_format" not in free.to_message()
    fmt = {"type": "json_schema", "schema": REFUND}
    job = Job.from_message({**MESSAGE, "response_format": fmt})
    assert job.to_message()["response_format"] == fmt
    assert Job.from_message(job.to_message()) == job
    assert job.fingerprint() != free.fingerprint()
    other = Job.from_message({**MESSAGE, "response_format": {"type": "choice", "choices": ["yes", "no"]}})
    assert other.fingerprint() != job.fingerprint()
    assert free.fingerprint() == Job.from_message(MESSAGE).fingerprint()


schemas = schema_draws.supported


@settings(max_examples=60, deadline=None, database=None)
@given(schemas)
def test_schemas_in_the_supported_subset_are_accepted(schema: dict[str, Any]) -> None:
    assert rf.schema_problem(schema) is None


# ------------------------------------------------------------------ the worker: grammar on the engine
SIZES = [(48, 64), (90, 120)]


def _item(index: int, new: int) -> GenerationInput:
    height, width = SIZES[index % len(SIZES)]
    image = torch.full((3, height, width), (30 + 37 * index) % 256, dtype=torch.uint8)
    return GenerationInput(image, ["Refund?", "What is damaged here?", "Which carrier?"][index % 3], new)


def _rows(backend: FuyuBackend, jobs: list[tuple[GenerationInput, Any]]) -> list[Sequence]:
    rows = []
    for index, (item, fmt) in enumerate(jobs):
        inputs, positions = backend.row_inputs(item)
        constraint = None if fmt is None else backend.grammars.constraint(rf.parse(fmt))[0]
        rows.append(
            Sequence(
                str(index), inputs, positions, item.max_new_tokens, backend.eos_id, constraint=constraint
            )
        )
    return rows


def _run(
    backend: FuyuBackend, rows: list[Sequence], arrivals: list[int], max_rows: int = 8
) -> dict[str, Sequence]:
    done: dict[str, Sequence] = {}
    engine = Engine(
        backend.step_model(max_rows), scheduler.Limits(max_rows, 0), lambda r: done.__setitem__(r.row_id, r)
    )
    pending = sorted(zip(arrivals, range(len(rows)), strict=True))
    while pending or not engine.idle:
        while pending and pending[0][0] <= engine.steps:
            engine.submit(rows[pending.pop(0)[1]])
        engine.step()
        assert engine.steps < 2000, "the engine does not finish"
    return done


def _alone(backend: FuyuBackend, item: GenerationInput, fmt: Any) -> Sequence:
    return _run(backend, _rows(backend, [(item, fmt)]), [0])["0"]


def _answer(backend: FuyuBackend, row: Sequence, fmt: Any) -> Any:
    assert row.error is None, row.error
    return rf.read_output(rf.parse(fmt), backend.detokenize(row.tokens))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.lists(schemas, min_size=1, max_size=3), st.lists(st.integers(0, 4), min_size=6, max_size=6))
def test_constrained_answers_validate_and_free_rows_beside_them_are_unchanged(
    backend: FuyuBackend, drawn: list[dict[str, Any]], arrivals: list[int]
) -> None:
    formats: list[Any] = [{"type": "json_schema", "schema": s} for s in drawn]
    formats.append({"type": "choice", "choices": ["refund", "replace", "no_action"]})
    jobs = [(_item(i, 512), fmt) for i, fmt in enumerate(formats)]  # room for the largest drawn answer
    free = [(_item(i + 7, 6), None) for i in range(2)]  # free rows: noise, unless the mask touched them
    done = _run(backend, _rows(backend, jobs + free), arrivals[: len(jobs) + len(free)])
    for index, (item, fmt) in enumerate(jobs):
        row = done[str(index)]
        assert row.tokens == _alone(backend, item, fmt).tokens, "a constrained row differs from its run alone"
        if isinstance(row.error, AnswerIncomplete):  # a drawn schema's longest answers exceed 512 tokens
            assert len(row.tokens) == item.max_new_tokens, row.error
            continue
        output = _answer(backend, row, fmt)  # read_output validates with jsonschema
        if fmt["type"] == "json_schema":
            jsonschema.validate(output, fmt["schema"])
            assert json.loads(backend.detokenize(row.tokens)) == output
        else:
            assert output in fmt["choices"]
    for offset, (item, _none) in enumerate(free):
        assert done[str(len(jobs) + offset)].tokens == _alone(backend, item, None).tokens


def test_refund_schema_and_choice_in_one_batch(backend: FuyuBackend) -> None:
    choice = {"type": "choice", "choices": ["refund", "replace", "no_action"]}
    refund = {"type": "json_schema", "schema": REFUND}
    done = _run(
        backend,
        _rows(backend, [(_item(0, 80), refund), (_item(1, 20), choice), (_item(2, 8), None)]),
        [0, 1, 2],
    )
    answer = _answer(backend, done["0"], refund)
    assert set(answer) == {"refund", "damage", "reason"}
    assert isinstance(answer["refund"], bool)
    assert _answer(backend, done["1"], choice) in choice["choices"]
    assert done["0"].finish_reason == done["1"].finish_reason == "stop"


def test_a_constrained_answer_cut_by_max_new_tokens_is_answer_incomplete(backend: FuyuBackend) -> None:
    refund = {"type": "json_schema", "schema": REFUND}
    row = _alone(backend, _item(0, 4), refund)
    assert isinstance(row.error, AnswerIncomplete)
    assert row.error.code == "answer_incomplete"
    assert not row.error.retryable
    assert len(row.tokens) == 4
    assert backend.detokenize(row.tokens).startswith("{")


@pytest.mark.parametrize(
    "fmt",
    [{"type": "json_schema", "schema": REFUND}, {"type": "choice", "choices": ["refund", "replace", "no"]}],
)
def test_a_whole_answer_that_only_end_of_text_may_follow_stops_there(backend: FuyuBackend, fmt: Any) -> None:
    """Review: a whole answer at exactly max_new_tokens ended `length` (the SDKs' `parse` refuses it),
    although the grammar allowed nothing after it but end-of-text. The row ends `stop` at its last
    token, the same tokens as with room to spare, and without the step that only confirmed it."""
    roomy = _alone(backend, _item(0, 80), fmt)
    assert roomy.finish_reason == "stop"
    assert roomy.constraint is not None
    assert roomy.constraint.only_end_left(backend.eos_id)
    exact = _alone(backend, _item(0, len(roomy.tokens)), fmt)
    assert (exact.tokens, exact.finish_reason, exact.error) == (roomy.tokens, "stop", None)
    assert _answer(backend, exact, fmt) == _answer(backend, roomy, fmt)


def test_a_paused_constrained_row_restarts_its_grammar(backend: FuyuBackend) -> None:
    """Recomputed from its prompt (a pause), the row's matcher starts over: the same answer again."""
    fmt = {"type": "json_schema", "schema": REFUND}
    (row,) = _rows(backend, [(_item(0, 80), fmt)])
    first = list(_run(backend, [row], [0])["0"].tokens)
    assert row.constraint is not None
    assert row.constraint.complete
    row.restart()
    assert not row.constraint.complete
    assert _run(backend, [row], [0])["0"].tokens == first


def test_the_mask_leaves_free_rows_logits_exactly_as_they_were(backend: FuyuBackend) -> None:
    grammars = backend.grammars
    constraint, _ = grammars.constraint(rf.parse({"type": "choice", "choices": ["refund", "no"]}))
    logits = torch.randn(3, grammars.vocab_size)
    masked = masks.apply(logits.clone(), masks.for_rows([None, constraint, None]))
    assert torch.equal(masked[0], logits[0])
    assert torch.equal(masked[2], logits[2])
    allowed = [
        backend.processor.tokenizer.convert_ids_to_tokens(i)
        for i in torch.isfinite(masked[1]).nonzero().flatten().tolist()
    ]
    assert allowed
    assert set(allowed) <= {"r", "n", "<0x72>", "<0x6E>"}, allowed
    assert masks.for_rows([None, None]) is None


def test_grammars_compile_once_per_format_and_keep_a_bounded_number(backend: FuyuBackend) -> None:
    grammars = Grammars(backend.processor.tokenizer, backend.grammars.vocab_size, backend.eos_id, keep=2)
    formats = [rf.parse({"type": "choice", "choices": [f"answer{i}", "other"]}) for i in range(3)]
    assert grammars.constraint(formats[0])[1] is not None  # compiled
    assert grammars.constraint(formats[0])[1] is None  # cached
    grammars.constraint(formats[1])
    grammars.constraint(formats[2])  # the least recently used (formats[0]) leaves
    assert grammars.constraint(formats[0])[1] is not None
    # Refused at submission now (a lookbehind); a message from another producer may still carry it.
    lookbehind = {"type": "string", "pattern": "(?<=a)b"}
    with pytest.raises(InvalidJob, match="does not compile"):
        grammars.constraint(rf.JsonSchemaFormat.model_construct(type="json_schema", schema_=lookbehind))


def test_a_grammar_one_key_compiled_is_never_found_by_another(backend: FuyuBackend) -> None:
    grammars = backend.grammars
    fmt = rf.parse({"type": "choice", "choices": ["kept", "apart"]})
    assert grammars.cached(fmt, "key-a") is None
    grammars.compile_and_keep(fmt, "key-a")
    assert grammars.cached(fmt, "key-a") is not None
    assert grammars.cached(fmt, "key-b") is None
    assert grammars.cached(fmt) is None  # jobs without a key (the CLI, a backlog) are one more owner


def test_one_key_sending_format_after_format_evicts_its_own_grammars_not_another_keys(
    backend: FuyuBackend,
) -> None:
    """Before, the kept grammars were one LRU over every key: a key sending new formats evicted every
    other key's, whose next jobs each waited a compile again (seconds for a costly format)."""
    grammars = Grammars(backend.processor.tokenizer, backend.grammars.vocab_size, backend.eos_id, keep=4)
    fmt = [rf.parse({"type": "choice", "choices": [f"answer{i}", "other"]}) for i in range(8)]
    grammars.compile_and_keep(fmt[0], "quiet")
    grammars.compile_and_keep(fmt[1], "quiet")
    for each in fmt[2:]:
        grammars.compile_and_keep(each, "busy")
    assert grammars.cached(fmt[0], "quiet") is not None
    assert grammars.cached(fmt[1], "quiet") is not None
    assert [grammars.cached(each, "busy") is not None for each in fmt[2:]] == [False] * 4 + [True] * 2
    grammars.compile_and_keep(fmt[2], "third")  # the busy key holds as many as the quiet one: LRU among both
    assert grammars.cached(fmt[0], "quiet") is None
    assert grammars.cached(fmt[1], "quiet") is not None
    assert grammars.cached(fmt[2], "third") is not None


def test_the_kept_grammars_are_bounded_by_their_bytes_as_well_as_their_count(backend: FuyuBackend) -> None:
    """Review, helper-115: bounded by count alone, 256 grammars of 0.6-4.9 MB each (a vocabulary of
    262,144 tokens) could hold a gigabyte of a worker's memory."""
    tokenizer, vocab, eos = backend.processor.tokenizer, backend.grammars.vocab_size, backend.eos_id
    fmt = [rf.parse({"type": "choice", "choices": [f"answer{i}", "other"]}) for i in range(6)]
    probe = Grammars(tokenizer, vocab, eos, keep=100)
    sizes = []
    for each in fmt:
        held = probe.held_bytes
        probe.compile_and_keep(each, "k")
        sizes.append(probe.held_bytes - held)
    assert min(sizes) > 0
    budget = sizes[-1] + sizes[-2] + sizes[-3] - 1  # the newest three do not fit: two do
    grammars = Grammars(tokenizer, vocab, eos, keep=100, keep_bytes=budget)
    for each in fmt:
        grammars.compile_and_keep(each, "k")
        assert grammars.held_bytes <= budget
    assert [grammars.cached(each, "k") is not None for each in fmt] == [False] * 4 + [True] * 2
    alone = Grammars(tokenizer, vocab, eos, keep=100, keep_bytes=1)  # the newest stays, whatever its size
    for each in fmt[:3]:
        alone.compile_and_keep(each, "k")
    assert [alone.cached(each, "k") is not None for each in fmt[:3]] == [False, False, True]


def test_bounded_strings_refuse_raw_control_characters(backend: FuyuBackend) -> None:
    """JSON requires U+0000-U+001F escaped; the library's bounded strings let them through raw."""
    fmt = rf.parse({"type": "json_schema", "schema": {"type": "string", "maxLength": 4}})
    for text, allowed in [('"ab"', True), ('"a\x15"', False), ('"a\tb"', False), ('"abcde"', False)]:
        constraint, _ = backend.grammars.constraint(fmt)
        accepted = constraint.matcher.accept_string(text) and constraint.complete
        assert accepted == allowed, text
