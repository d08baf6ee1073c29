"""The OpenAI-compatible surface without services: what a chat request may hold (accepted, refused by
name, refused by mrc's job checks), errors in OpenAI's shape, and a batch file's request count."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import pytest

from producer.openai.chat_request import parse_chat
from producer.openai.errors import OpenAIError, from_usage_error, openai_body
from producer.openai.files import count_requests, upload_digest
from shared.settings import Settings

SETTINGS = Settings(s3_bucket="mrc-photos", s3_prefix="tenant-a/", max_image_bytes=1000)
IMAGE = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"x" * 50).decode()


def _request(**fields: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "Refund?"}, {"type": "image_url", "image_url": {"url": IMAGE}}]
    return {"model": "m", "messages": [{"role": "user", "content": content}], **fields}


def _refusal(body: object) -> tuple[int, str | None, str | None]:
    with pytest.raises(OpenAIError) as caught:
        parse_chat(body, SETTINGS)
    return caught.value.status, caught.value.param, caught.value.code


def _served_here(model: str) -> None:
    if model != "m":
        raise OpenAIError(404, f"The model `{model}` does not exist", "model", "model_not_found")


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Refund?"}],  # no image
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}}] * 2}],  # two
        [{"role": "user", "content": [{"type": "text", "text": "x" * 20_000}]}],  # a prompt too long
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x/y.jpg"}}]}],
    ],
    ids=["no image", "two images", "prompt too long", "a URL mrc may not read"],
)
def test_a_model_no_worker_serves_is_404_whatever_the_messages_hold(messages: list[Any]) -> None:
    """Review, helper-92: "model": "gpt-4o" and no image was 400 image_required, where the contract says
    another model is 404 model_not_found; the messages were read before the model was looked up."""
    with pytest.raises(OpenAIError) as refused:
        parse_chat(_request(model="gpt-4o", messages=messages), SETTINGS, check_model=_served_here)
    refusal = (refused.value.status, refused.value.param, refused.value.code)
    assert refusal == (404, "model", "model_not_found")
    with pytest.raises(OpenAIError) as served:  # the same messages to the model served: their own error
        parse_chat(_request(messages=messages), SETTINGS, check_model=_served_here)
    assert served.value.status == 400


def test_a_plain_request_reads_into_one_job() -> None:
    chat = parse_chat(
        _request(max_completion_tokens=7, metadata={"ticket_id": "T-1", "job_id": "j-1"}), SETTINGS
    )
    assert (chat.prompt, chat.max_new_tokens, chat.ticket_id, chat.job_id) == ("Refund?", 7, "T-1", "j-1")
    assert chat.image is None
    assert (chat.data or b"").startswith(b"\x89PNG")
    assert chat.image_param == "messages[0].content[1].image_url.url"


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0, "top_p": 1, "n": 1, "stream": False, "presence_penalty": 0, "logprobs": False},
        {"stop": [], "tools": [], "tool_choice": "none", "seed": 7, "user": "u-1", "store": True},
        {"response_format": {"type": "text"}, "service_tier": "auto", "modalities": ["text"]},
        # what frameworks send on every request (LangChain, LiteLLM): floats, and stream_options
        {
            "temperature": 0.0,
            "top_p": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "parallel_tool_calls": False,
            "logprobs": False,
            "stream_options": {"include_usage": True},
        },
    ],
)
def test_settings_that_change_nothing_for_a_greedy_answer_are_accepted(fields: dict[str, Any]) -> None:
    assert parse_chat(_request(**fields), SETTINGS).response_format is None


def test_a_conversation_is_never_cut_and_a_lone_question_follows_the_setting() -> None:
    assert parse_chat(_request(), SETTINGS).truncate is True
    content = _request()["messages"][0]["content"]
    talk = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    assert parse_chat(_request(messages=talk), SETTINGS).truncate is False


def test_a_streamed_request_asks_for_its_usage_chunk_only_when_it_streams() -> None:
    options = {"stream_options": {"include_usage": True}}
    streamed = parse_chat(_request(stream=True, **options), SETTINGS)
    assert (streamed.stream, streamed.include_usage) == (True, True)
    assert parse_chat(_request(stream=True), SETTINGS).include_usage is False
    plain = parse_chat(_request(**options), SETTINGS)
    assert (plain.stream, plain.include_usage) == (False, False)
    with pytest.raises(OpenAIError) as line:  # a batch line's answer goes whole into the output file
        parse_chat(_request(stream=True), SETTINGS, batch=True)
    assert (line.value.status, line.value.param, line.value.code) == (400, "stream", "unsupported_value")


@pytest.mark.parametrize(
    ("fields", "status", "param", "code"),
    [
        ({"stream": "yes"}, 400, "stream", "invalid_value"),
        ({"temperature": 0.2}, 400, "temperature", "unsupported_value"),
        ({"n": 3}, 400, "n", "unsupported_value"),
        ({"stop": ["\n"]}, 400, "stop", "unsupported_value"),
        ({"logprobs": True}, 400, "logprobs", "unsupported_value"),
        ({"stream_options": {"include_usage": 1}}, 400, "stream_options", "unsupported_value"),
        ({"stream_options": {"chunk_size": 4}}, 400, "stream_options", "unsupported_value"),
        ({"reasoning_effort": "low"}, 400, "reasoning_effort", "unsupported_value"),
        ({"guided_json": {}}, 400, "guided_json", "unknown_parameter"),
        ({"max_tokens": "5"}, 400, "max_tokens", "invalid_value"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, 400, "max_tokens", "invalid_value"),
        ({"max_completion_tokens": 100_000}, 400, "max_completion_tokens", "invalid_value"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata", "invalid_value"),
        ({"metadata": {"job_id": "no spaces please"}}, 400, "metadata.job_id", "invalid_job"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
         "response_format.json_schema.schema", "missing_required_parameter"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}}, 400,
         "response_format.json_schema.schema", "invalid_job"),
        ({"messages": []}, 400, "messages", "invalid_value"),
        ({"messages": [{"role": "system", "content": "Be brief."}]}, 400, "messages[0].role",
         "unsupported_value"),  # the last message must be the user's
        ({"messages": [{"role": "user", "content": "No image?"}]}, 400, "messages", "image_required"),
        ({"messages": [{"role": "tool", "content": "42"}, {"role": "user", "content": "Hm?"}]}, 400,
         "messages[0].role", "unsupported_value"),
        ({"messages": [{"role": "assistant", "content": None}, {"role": "user", "content": "Hm?"}]}, 400,
         "messages[0].content", "invalid_value"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400,
         "messages[0].content[0]", "invalid_value"),
        # A tool's answer carries its call's id: refused for its role, not for the id (review).
        ({"messages": [{"role": "tool", "tool_call_id": "c1", "content": "42"},
                       {"role": "user", "content": "Hm?"}]}, 400, "messages[0].role", "unsupported_value"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                       {"role": "user", "content": "Hm?"}]}, 400, "messages[0].tool_calls",
         "unsupported_value"),
        ({"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a1"}},
                       {"role": "user", "content": "Hm?"}]}, 400, "messages[0].audio", "unsupported_value"),
        ({"messages": [{"role": "user", "content": "x", "refusal": "no"}]}, 400, "messages[0].refusal",
         "unsupported_value"),
        ({"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}, 400,
         "messages[0].content[0]", "unsupported_value"),
        ({"messages": [{"role": "user", "content": "x", "parsed": {"a": 1}}]}, 400, "messages[0].parsed",
         "unsupported_value"),
        ({"messages": [{"role": "system", "content": "x", "annotations": []},
                       {"role": "user", "content": "Hm?"}]}, 400, "messages[0].annotations",
         "unsupported_value"),
        ({"model": None}, 400, "model", "invalid_value"),
        # Counted before validated (review: 1.3 million empty messages held the event loop 9 s).
        ({"messages": [{"role": "user", "content": ""}] * 257}, 400, "messages", "invalid_value"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 65}]}, 400,
         "messages[0].content", "invalid_value"),
    ],
)  # fmt: skip
def test_what_mrc_cannot_do_is_refused_by_name(
    fields: dict[str, Any], status: int, param: str, code: str
) -> None:
    assert _refusal(_request(**fields)) == (status, param, code)


@pytest.mark.parametrize(
    ("url", "status", "code"),
    [
        ("https://example.com/a.jpg", 400, "image_source_forbidden"),
        ("s3://other-bucket/a.jpg", 400, "image_source_forbidden"),
        ("s3://mrc-photos/tenant-b/a.jpg", 400, "image_source_forbidden"),  # our bucket, another prefix
        ("s3://mrc-photos/tenant-a/../x.jpg", 400, "invalid_value"),
        ("data:image/png,not-base64", 400, "invalid_value"),
        ("data:image/png;base64,@@@@", 400, "invalid_value"),
        ("data:image/png;base64," + "A" * 2000, 400, "image_too_large"),  # decodes past 1,000 bytes
        # Not an image type (review, helper-84: these were taken, the bytes decoded as whatever they were)
        ("data:text/plain;base64," + IMAGE.split(",", 1)[1], 400, "invalid_value"),
        ("data:;base64," + IMAGE.split(",", 1)[1], 400, "invalid_value"),
        ("data:application/octet-stream;base64," + IMAGE.split(",", 1)[1], 400, "invalid_value"),
    ],
)
def test_images_come_as_base64_or_from_our_bucket(url: str, status: int, code: str) -> None:
    body = _request(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Refund?"}, {"type": "image_url", "image_url": {"url": url}}]}])  # fmt: skip
    assert _refusal(body) == (status, "messages[0].content[1].image_url.url", code)
    ours = _request(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "s3://mrc-photos/tenant-a/x.jpg", "detail": "high"}},
        {"type": "text", "text": "Refund?"}]}])  # fmt: skip
    assert parse_chat(ours, SETTINGS).image == "s3://mrc-photos/tenant-a/x.jpg"
    shouted = {"type": "image_url", "image_url": {"url": "DATA:" + IMAGE[5:]}}  # schemes ignore case
    upper = _request(messages=[{"role": "user", "content": [{"type": "text", "text": "Refund?"}, shouted]}])
    assert parse_chat(upper, SETTINGS).data is not None


def test_json_object_and_json_schema_become_constrained_answers() -> None:
    as_object = parse_chat(_request(response_format={"type": "json_object"}), SETTINGS)
    assert as_object.response_format == {"type": "json_schema", "schema": {"type": "object"}}
    schema = {"type": "object", "properties": {"refund": {"type": "boolean"}}, "required": ["refund"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    assert parse_chat(_request(response_format=fmt), SETTINGS).response_format == {
        "type": "json_schema",
        "schema": schema,
    }


def test_every_error_body_leaves_in_openai_shape() -> None:
    mrc = openai_body(401, json.dumps({"error": {"code": "unauthorized", "message": "no key"}}).encode())
    assert mrc == {"error": {"code": "invalid_api_key", "message": "no key", "type": "invalid_request_error",
                             "param": None}}  # fmt: skip
    fastapi = openai_body(405, b'{"detail": "Method Not Allowed"}')["error"]
    assert (fastapi["message"], fastapi["type"], fastapi["code"]) == (
        "Method Not Allowed",
        "invalid_request_error",
        None,
    )
    assert openai_body(503, b"plain text")["error"]["type"] == "server_error"
    kept = openai_body(
        504, OpenAIError(504, "slow", None, "answer_timeout", extra={"job_id": "j"}).response().body
    )
    expected = {"message": "slow", "type": "timeout_error", "param": None, "code": "answer_timeout"}
    assert kept["error"] == {**expected, "job_id": "j"}
    # What mrc's job checks refuse is a request OpenAI would refuse: 400 (BadRequestError), code kept.
    assert (from_usage_error("image_too_large: 9 pixels").status, from_usage_error("x").code) == (
        400,
        "invalid_job",
    )
    assert from_usage_error("job id j is already used by a different job (...)").status == 409


@pytest.mark.parametrize(
    ("text", "requests"),
    [(b"", 0), (b"\n \n", 0), (b"{}", 1), (b"{}\n{}\n", 2), (b"{}\r\n\r\n{}", 2), (b" {}\n" * 3, 3)],
)
def test_a_batch_file_counts_its_non_blank_lines(text: bytes, requests: int) -> None:
    assert count_requests(io.BytesIO(text)) == (len(text), requests)


def _image_part(url: str = IMAGE) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_conversation_is_folded_into_one_prompt_as_the_contract_says() -> None:
    """Instructions, then history (one line a turn), then the question, blank lines between; the
    photo from wherever it stands; one user message alone is its text exactly."""
    messages = [
        {"role": "system", "content": "You inspect parcels for a courier."},
        {"role": "developer", "content": [{"type": "text", "text": "Answer in one word."}]},
        {"role": "user", "content": [_image_part(), {"type": "text", "text": "What colour is it?"}]},
        {"role": "assistant", "content": "Brown."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Is it"}, {"type": "text", "text": "damaged?"}],
        },
    ]
    chat = parse_chat(_request(messages=messages), SETTINGS)
    assert chat.prompt == (
        "You inspect parcels for a courier.\nAnswer in one word.\n\n"
        "User: What colour is it?\nAssistant: Brown.\n\n"
        "Is it\ndamaged?"
    )
    assert chat.image_param == "messages[2].content[0].image_url.url"
    assert (chat.data or b"").startswith(b"\x89PNG")
    alone = parse_chat(_request(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Refund?"}, _image_part()]}]), SETTINGS)  # fmt: skip
    assert alone.prompt == "Refund?"
    described = [{"role": "system", "content": "Describe the parcel."},
                 {"role": "user", "content": [_image_part()]}]  # fmt: skip
    system = parse_chat(_request(messages=described), SETTINGS)
    assert system.prompt == "Describe the parcel."
    blanks = [
        {"role": "system", "content": [{"type": "text", "text": ""}, {"type": "text", "text": " "}]},
        {"role": "user", "content": [{"type": "text", "text": ""}, _image_part()]},
        {"role": "user", "content": [{"type": "text", "text": "Q"}, {"type": "text", "text": ""}]},
    ]
    assert parse_chat(_request(messages=blanks), SETTINGS).prompt == "Q"  # blank parts add nothing


@pytest.mark.parametrize(
    ("messages", "param", "code"),
    [
        ([{"role": "user", "content": [_image_part(), _image_part(), {"type": "text", "text": "Same?"}]}],
         "messages[0].content[1].image_url.url", "too_many_images"),
        ([{"role": "user", "content": [_image_part(), {"type": "text", "text": "This one"}]},
          {"role": "assistant", "content": "Brown."},
          {"role": "user", "content": [_image_part(), {"type": "text", "text": "and this?"}]}],
         "messages[2].content[0].image_url.url", "too_many_images"),
        ([{"role": "system", "content": [_image_part()]}, {"role": "user", "content": "Hm?"}],
         "messages[0].content[0].image_url.url", "unsupported_value"),
        ([{"role": "user", "content": [_image_part(), {"type": "text", "text": "Refund?"}]},
          {"role": "assistant", "content": "Yes, because"}],
         "messages[1].role", "unsupported_value"),
    ],
)  # fmt: skip
def test_a_conversation_mrc_cannot_answer_is_refused_by_name(
    messages: list[dict[str, Any]], param: str, code: str
) -> None:
    assert _refusal(_request(messages=messages)) == (400, param, code)


def test_instructions_and_history_meet_the_prompt_checks_as_the_question_does() -> None:
    """They are the prompt: a NUL is refused wherever it stands, and the length limit counts them
    (control-token text is defused in all of it by the intake, producer/intake/intake.py)."""
    for role in ("system", "assistant"):
        messages = [
            {"role": role, "content": "ok \x00"},
            {"role": "user", "content": [_image_part(), {"type": "text", "text": "Refund?"}]},
        ]
        status, param, code = _refusal(_request(messages=messages))
        assert (status, param, code) == (400, "messages", "invalid_job"), role
    long = Settings(s3_bucket="mrc-photos", max_prompt_chars=40)
    messages = [
        {"role": "system", "content": "x" * 30},
        {"role": "user", "content": [_image_part(), {"type": "text", "text": "y" * 20}]},
    ]
    with pytest.raises(OpenAIError) as caught:
        parse_chat(_request(messages=messages), long)
    assert (caught.value.param, caught.value.code) == ("messages", "invalid_job")
    assert "52 characters" in caught.value.message


def test_a_batch_line_names_no_url_to_fetch() -> None:
    """Fetching is for chat requests: a batch line's URL would hold the whole batch's enqueue."""
    allowed = Settings(s3_bucket="mrc-photos", image_url_hosts="photos.example.com")
    body = _request(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Refund?"}, _image_part("https://photos.example.com/a.jpg")]}])  # fmt: skip
    with pytest.raises(OpenAIError) as refused:
        parse_chat(body, allowed, batch=True)
    assert (refused.value.param, refused.value.code) == (
        "messages[0].content[1].image_url.url",
        "image_source_forbidden",
    )


def test_an_error_that_quotes_text_no_store_could_write_still_answers() -> None:
    """Refusals quote what a client sent (a URL's host, a model, an id): one with a lone surrogate is
    still written, the surrogate replaced, in both error shapes (review: it was a 500)."""
    from producer.http.forms import error

    for response in (OpenAIError(400, "model \udcff is unknown", "model", "model_not_found").response(),
                     error(404, "not_found", "no job x\ud83d")):  # fmt: skip
        message = json.loads(response.body.decode("utf-8"))["error"]["message"]
        assert "\ufffd" in message, message


def test_an_earlier_answer_sent_back_as_the_sdk_sends_it_is_a_turn() -> None:
    """`messages.append(choice.message)` sends mrc's own answer back with `refusal: null`,
    `annotations: []`, `audio`, `function_call` and `tool_calls` null (review: refused as unknown
    parameters, so a conversation could not go on); a refusal, as text or as a part, is that turn's
    text."""
    question = {"role": "user", "content": [_image_part(), {"type": "text", "text": "What colour?"}]}
    echoed = {"role": "assistant", "content": "Brown.", "refusal": None, "annotations": [], "audio": None,
              "function_call": None, "tool_calls": None, "parsed": {"colour": "brown"}}  # fmt: skip
    follow_up = {"role": "user", "content": "Is it torn?"}
    chat = parse_chat(_request(messages=[question, echoed, follow_up]), SETTINGS)
    assert chat.prompt == "User: What colour?\nAssistant: Brown.\n\nIs it torn?"
    for refused in (
        {"role": "assistant", "content": None, "refusal": "I cannot say."},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot say."}], "tool_calls": []},
    ):
        chat = parse_chat(_request(messages=[question, refused, follow_up]), SETTINGS)
        assert chat.prompt == "User: What colour?\nAssistant: I cannot say.\n\nIs it torn?"


def test_an_uploads_name_ends_where_its_digest_says_it_does() -> None:
    """Review, helper-103: name `x` with bytes `\\0{...}` and name `x\\0` with bytes `{...}` had one
    digest, so the second upload was answered with the first file (its size, its bytes)."""
    body = b'{"custom_id":"a"}\n'
    one = upload_digest(io.BytesIO(b"\0" + body), "x", "batch")
    other = upload_digest(io.BytesIO(body), "x\0", "batch")
    assert one != other
    stream = io.BytesIO(body)
    assert upload_digest(stream, "x", "batch") == upload_digest(io.BytesIO(body), "x", "batch")
    assert stream.tell() == 0  # left at its start, for the upload that follows
    assert upload_digest(io.BytesIO(body), "\udcff.jsonl", "batch")  # a name decoded to a lone surrogate
