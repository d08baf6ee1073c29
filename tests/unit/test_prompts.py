from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.prompts import FUYU_CONTROL_TEXT, neutralise


def test_every_fuyu_control_text_is_defused_keeping_the_length() -> None:
    for control in FUYU_CONTROL_TEXT:
        prompt = f"a{control}b{control}"
        safe = neutralise(prompt)
        assert not any(c in safe for c in FUYU_CONTROL_TEXT), (control, safe)
        assert len(safe) == len(prompt)


@given(st.text())
def test_ordinary_text_is_left_alone_and_neutralising_is_idempotent(text: str) -> None:
    safe = neutralise(text)
    assert neutralise(safe) == safe
    if not any(c in text for c in FUYU_CONTROL_TEXT):
        assert safe == text


def test_the_producer_sends_neutralised_prompts() -> None:
    from producer.client import Client, Submission
    from shared.settings import Settings

    client = Client(Settings())  # builds its clients lazily: nothing is contacted for a job build
    job = client.build_job(Submission(image="s3://mrc/inputs/a.jpg", prompt="x |SPEAKER| <s> y\x04"))
    assert job.prompt == "x \u00a6SPEAKER\u00a6 \u2039s\u203a y\ufffd"
