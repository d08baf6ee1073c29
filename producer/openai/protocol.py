"""OpenAI's chat completion request as pydantic models: the fields OpenAI defines, strictly typed,
anything else refused (`extra="forbid"`). What mrc does with each field is decided in
producer/openai/chat_request.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ImageURL(_Strict):
    url: str = Field(description="data:image/...;base64,... or s3://bucket/key (never fetched from http)")
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


MAX_MESSAGES = 256  # a request's messages
MAX_PARTS = 64  # a message's content parts


class RefusalPart(_Strict):
    """An assistant's refusal, as an earlier turn sends it back."""

    type: Literal["refusal"]
    refusal: str


Part = Annotated[TextPart | ImagePart | RefusalPart, Field(discriminator="type")]


class Message(_Strict):
    role: str = Field(description="system, developer, user or assistant (producer/openai/chat_messages.py)")
    content: str | Annotated[list[Part], Field(max_length=MAX_PARTS)] | None = None
    name: str | None = None
    # What an SDK sends back with an earlier answer (`messages.append(choice.message)`): taken when
    # empty; a refusal is the turn's text; tools and audio are refused by name (chat_messages.py).
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None
    tool_call_id: str | None = None
    parsed: Any = None  # what the SDK's `parse()` read the answer into: the content says the same


class JsonSchemaSpec(_Strict):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


Format = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class ChatRequest(_Strict):
    """The fields OpenAI's chat completions define; what mrc does with each: module docstring."""

    model: str
    # Bounded before its items are validated (review: 1.3 million empty messages, a legal 43 MB body,
    # held the API's event loop 9 s): a conversation about one photo is far shorter, and its prompt is
    # bounded in tokens anyway (MRC_MAX_PROMPT_TOKENS).
    messages: list[Message] = Field(max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    response_format: Format | None = None
    metadata: dict[str, str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, int] | None = None
    seed: int | None = None
    user: str | None = None
    store: bool | None = None
    service_tier: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Any = None
    safety_identifier: str | None = None
