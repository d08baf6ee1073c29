"""The model stage of a delivery over the echo model (issue 36): a grammar that compiles slowly holds
neither the jobs beside it nor a second compile of itself (item 9). States and counts only: the slow
compile is a stand-in the test holds and releases."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from shared import response_format as rf
from shared.memory_records import MemoryJobRecords
from shared.settings import Settings
from shared.stores.memory import MemoryStore
from tests.support import imagegen
from workers.backends.echo import EchoBackend
from workers.pipeline import Pipeline, assemble
from workers.slots import Message

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

    def cached(self, fmt: Any) -> Any:
        return self.kept.get(rf.digest(fmt))

    def compile_and_keep(self, fmt: Any) -> tuple[Any, float]:
        self.compiles.append(rf.canonical(fmt))
        if "slow" in rf.canonical(fmt):
            self.release.wait(GUARD_S)
            self.returned.set()
        self.kept[rf.digest(fmt)] = "grammar"
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
    # Once it ends, its grammar is kept: the format's next job runs without compiling it again.
    assert pipeline.run([_job("held-later", response_format=slow)]) == ["succeeded"]
    assert sum("slow" in c for c in grammars.compiles) == 1
