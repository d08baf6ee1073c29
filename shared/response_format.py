"""Structured answers: a job's `response_format`, checked where no torch runs (mrc submit, manifests,
mrc-api, and the worker's first look at a message), and the answer read back from the generated text.

The worker constrains generation with a grammar compiled from the format (workers/grammar.py); what is
refused here is what that grammar cannot guarantee. A JSON Schema keyword the decoder would silently
ignore (`oneOf` exclusivity, `uniqueItems`, `not`...) is refused by name rather than accepted and broken:
a caller who asks for a constraint gets it, or is told at submission that it cannot be had.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from shared import encoding, pattern_match, schema_bounds, schema_rules, schema_values

# A ceiling whatever the deployment's own (smaller) limit says: checked before the schema is walked.
HARD_MAX_BYTES = 1 << 20


class JsonSchemaFormat(BaseModel):
    """`{"type": "json_schema", "schema": {...}}`: the answer is JSON that validates against it."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    @field_validator("schema_")
    @classmethod
    def _enforceable(cls, value: dict[str, Any]) -> dict[str, Any]:
        problem = _outer_problem(value, HARD_MAX_BYTES) or schema_problem(value)
        if problem:
            raise ValueError(problem)
        return value


class ChoiceFormat(BaseModel):
    """`{"type": "choice", "choices": [...]}`: the answer is exactly one of the strings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["choice"]
    choices: list[str]

    @field_validator("choices")
    @classmethod
    def _usable(cls, value: list[str]) -> list[str]:
        problem = choices_problem(value)
        if problem:
            raise ValueError(problem)
        return value


ResponseFormat = Annotated[JsonSchemaFormat | ChoiceFormat, Field(discriminator="type")]


_ADAPTER: TypeAdapter[JsonSchemaFormat | ChoiceFormat] = TypeAdapter(ResponseFormat)


def parse(value: object, max_bytes: int = HARD_MAX_BYTES) -> JsonSchemaFormat | ChoiceFormat | None:
    """A response format from JSON data (a dict, or a model already), or None; ValueError saying
    which field is wrong otherwise. Nesting, text no store could write and the size limit come first,
    so an oversized or hostile schema is refused before anything walks it."""
    if value is None or isinstance(value, JsonSchemaFormat | ChoiceFormat):
        return value
    problem = _outer_problem(value, max_bytes, "response_format")
    if problem:
        raise ValueError(problem)
    try:
        return _ADAPTER.validate_python(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        where = ".".join(loc[1:] if loc and loc[0] in ("json_schema", "choice") else loc)
        message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        raise ValueError(f"response_format{'.' + where if where else ''}: {message}") from None


def _outer_problem(value: object, max_bytes: int, name: str = "the schema") -> str | None:
    """Nesting, text no store can write, and compact size: what is checked before anything walks it."""
    problem = encoding.depth_problem(value) or encoding.unwritable(value, name)
    if problem:
        return problem
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        return f"{name} is {size} bytes as compact JSON; the limit is {max_bytes}"
    if '"__type__"' in text and '"__value__"' in text:  # rare: walked only then
        return _typed_problem(value, name)
    return None


def _typed_problem(value: object, name: str) -> str | None:
    """An object of exactly `__type__` and `__value__`: the broker's JSON (kombu's) reads it back as a
    typed value, so the worker could not read the job's message, and Celery dropped it unanswered
    (review, helper-125: the job stayed `queued` for good)."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            if item.keys() == {"__type__", "__value__"}:
                return (
                    f"{name} at /{path}: an object of exactly `__type__` and `__value__` is not carried "
                    "as it is (the queue's JSON reads it as a typed value); add or rename a member"
                )
            stack.extend((child, f"{path}/{key}" if path else str(key)) for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((child, f"{path}/{i}" if path else str(i)) for i, child in enumerate(item))
    return None


def choices_problem(choices: list[str]) -> str | None:
    if not choices:
        return "the list is empty"
    seen: set[str] = set()
    for choice in choices:
        if not choice:
            return "an empty string is not a choice"
        if any(ord(c) < 32 or ord(c) == 127 for c in choice):
            return f"{choice[:40]!r} contains a control character"
        unwritable = schema_values.choice_problem(choice)
        if unwritable:
            return unwritable
        if choice in seen:
            return f"{choice[:40]!r} is listed twice"
        seen.add(choice)
    return None


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why the decoder cannot enforce this schema (invalid JSON Schema, or a keyword it does not
    enforce, named with its place), or None."""
    try:
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/" + "/".join(str(p) for p in exc.absolute_path)
        return f"not valid JSON Schema at {where}: {exc.message[:200]}"
    except Exception as exc:  # whatever a hostile schema makes the validator raise is a refusal
        return f"not valid JSON Schema: {type(exc).__name__}: {str(exc)[:200]}"
    return schema_rules.problem(schema)


def canonical(fmt: JsonSchemaFormat | ChoiceFormat) -> str:
    """The format as compact, key-sorted JSON: what its size limit counts and its hash covers."""
    return json.dumps(
        fmt.model_dump(by_alias=True), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


def digest(fmt: JsonSchemaFormat | ChoiceFormat) -> str:
    return hashlib.sha256(canonical(fmt).encode("utf-8", "surrogatepass")).hexdigest()


def size_problem(fmt: JsonSchemaFormat | ChoiceFormat, max_bytes: int, max_choices: int) -> str | None:
    """The deployment's limits (settings): compact size and number of choices."""
    size = len(canonical(fmt).encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        return f"response_format is {size} bytes as compact JSON; the limit is {max_bytes}"
    if isinstance(fmt, ChoiceFormat) and len(fmt.choices) > max_choices:
        return f"response_format has {len(fmt.choices)} choices; the limit is {max_choices}"
    return None


def reach_problem(fmt: JsonSchemaFormat | ChoiceFormat, tokens: int, token_chars: int) -> str | None:
    """A bound the job's max_new_tokens can never meet or reach (shared/schema_bounds.py), by place."""
    reach = schema_bounds.Reach(tokens, token_chars)
    if isinstance(fmt, ChoiceFormat):
        return schema_bounds.choices_problem(fmt.choices, reach)
    return schema_bounds.schema_problem(fmt.schema_, reach)


def read_output(fmt: JsonSchemaFormat | ChoiceFormat, text: str) -> Any:
    """The answer as the caller asked for it: the parsed JSON value, or the chosen string. Raises
    ValueError when the text is not one (never expected of a constrained answer: a last guard, so an
    `output` that does not validate is never handed out)."""
    if isinstance(fmt, ChoiceFormat):
        if text not in fmt.choices:
            raise ValueError(f"the answer {text[:60]!r} is not one of the choices")
        return text
    value = encoding.loads(text)  # deeper than encoding.MAX_DEPTH: a ValueError, never a RecursionError
    error = jsonschema.exceptions.best_match(_validator(fmt.schema_).iter_errors(value))
    if error is not None:
        raise ValueError(f"the answer does not validate against its schema: {error.message[:200]}")
    return value


def _validator(schema: dict[str, Any]) -> Any:
    # `pattern` in bounded time, never `re`'s backtracking; one past the budget is the decoder's word
    return pattern_match.validator(schema, trust_costly=True)


def parse_choice_list(text: str) -> list[str]:
    """`--choice refund,replace,no_action` -> the list (each entry stripped of surrounding spaces)."""
    return [part.strip() for part in text.split(",")]
