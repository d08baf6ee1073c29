"""Accuracy as the end-to-end test: the `parcels` model (a tiny Fuyu trained on synthetic parcel photos)
answers questions about fresh photos, submitted through mrc-api to real workers, read back from the
result objects in S3.

A resize that shifts colours, patches cut in the wrong order, a normalisation off by one step, NF4
drifting from fp32, a grammar that pushes the model off its answer: each passes every shape-and-
determinism test, and each fails here. The images come from seeds no training batch drew
(scripts/train_parcels.py draws from 10^9 up; these are below).

Lean on purpose (make test's budget): one run, one worker per quantization, everything submitted at
once so the engines batch, two new tokens per free answer.
"""

from __future__ import annotations

import pytest

from tests.support import parcel_accuracy
from tests.support.parcel_accuracy import Run

pytestmark = pytest.mark.integration

# 60 photos (300 jobs to the fp32 worker, 180 to the NF4 one): a 0.97 threshold below leaves room for
# one miss, and the answers are deterministic (seeded photos, greedy decoding): on 2026-12-06 colour
# was 100 %, damage and digit 98 %, NF4's agreement 99-100 % on 80 photos. 80 cost make test ~10 s
# more on two cores (its setup took 45 s there), and the whole range is measured by the benchmark.
IMAGES = 60
SEED = 950_000_000
# Photos of every aspect the world allows, no wider than this: a job's cost grows with its patches
# (640 px: 173 positions on average against 290 for the whole world). The whole range is measured by
# tests/bench/bench_parcel_accuracy.py (docs/benchmarks.md) and by the training's held-out set.
WIDEST = 640
# Training reached 94 % on the digit held out (workers/models/parcels/training.json): asserted.
DIGIT_ASSERTED = True


@pytest.fixture(scope="module")
def answers(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Run:
    folder = tmp_path_factory.mktemp("parcel-accuracy")
    envs = {
        "fp32": parcel_accuracy.worker_env(env, "fp32", 1),
        "nf4": parcel_accuracy.worker_env(env, "nf4", 2),
    }
    with pytest.MonkeyPatch.context() as patch, parcel_accuracy.workers(envs, folder) as started:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
            patch.setenv(name, env[name])  # the in-process API and client
        outcome = parcel_accuracy.run(envs, IMAGES, SEED, widest=WIDEST)
        for worker in started.values():
            assert worker.proc.poll() is None
    print(f"\nparcel accuracy: {len(outcome.jobs)} jobs in {outcome.seconds:.1f} s")
    return outcome


def test_fp32_answers_colour_and_damage(answers: Run) -> None:
    colour, damage = answers.accuracy("fp32", "colour"), answers.accuracy("fp32", "damage")
    digit = answers.accuracy("fp32", "digit")
    print(f"fp32: colour {colour:.0%} damage {damage:.0%} digit {digit:.0%}")
    assert colour >= 0.97
    assert damage >= 0.93
    if DIGIT_ASSERTED:
        assert digit >= 0.80
    every = list(answers.results.values())
    assert all(r["status"] == "succeeded" for r in every), [r["error"] for r in every if r["error"]]
    assert all(r["model"]["id"] == "parcels-fuyu-v1" for r in every)


def test_nf4_agrees_with_fp32(answers: Run) -> None:
    for kind in ("colour", "damage", "digit"):
        agreement = answers.agreement(kind, "fp32", "nf4")
        fp32, nf4 = answers.accuracy("fp32", kind), answers.accuracy("nf4", kind)
        print(f"nf4 {kind}: agreement {agreement:.0%}, accuracy {nf4:.0%} (fp32 {fp32:.0%})")
        assert agreement >= 0.97, kind
        assert abs(nf4 - fp32) <= 0.02, kind
    assert {r["model"]["quantization"] for r in answers.answers("nf4", "colour").values()} == {"nf4"}


def test_choice_answers_are_choices_and_right(answers: Run) -> None:
    chosen = answers.answers("fp32", "choice").values()
    assert all(r["output"] in parcel_accuracy.CHOICES and r["text"] == r["output"] for r in chosen)
    assert answers.accuracy("fp32", "choice") >= 0.97


def test_one_json_answer_holds_all_three(answers: Run) -> None:
    import jsonschema

    from scripts import parcels

    for result in answers.answers("fp32", "json").values():
        assert result["status"] == "succeeded", result["error"]
        jsonschema.validate(result["output"], parcels.SCHEMA)
    for field, kind in (("colour", "colour"), ("damaged", "damage"), ("digit", "digit")):
        structured, free = answers.accuracy("fp32", f"json.{field}"), answers.accuracy("fp32", kind)
        print(f"json {field}: {structured:.0%} (free {free:.0%})")
        assert abs(structured - free) <= 0.03, field
