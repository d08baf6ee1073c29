"""A conversation as clients send it, folded into the one prompt an mrc job carries.

The model has no chat template (Fuyu reads an image, then text, then answers), so a conversation
becomes plain text, the same way every time:

- the `system` and `developer` messages' text, in order, one per line: the instructions block;
- every `user` and `assistant` message before the last, in order, one entry each: `User: TEXT` or
  `Assistant: TEXT`, TEXT as sent (its newlines kept; a message with no text, only the photo, adds
  none): the history block;
- the last message, which must be the user's: its text, as it is;

the blocks that are not empty, joined by one blank line ("\\n\\n"). A message's text parts are joined
by one newline, blank parts left out; where its image part stands changes nothing. A request of one
user message is therefore its text exactly, as before conversations were accepted (the same answer,
the same cache key).

One image per request: the first `image_url` part of any user message (a follow-up about the photo
sent in an earlier turn keeps it); a second image is refused by name, and so is a conversation with
none (the worker's models answer about a photo: text-only jobs are not offered). What the model sees is
this prompt: `usage.prompt_tokens` counts it, instructions and history included, and mrc's prompt
checks (limits, control tokens) apply to all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from producer.openai.errors import OpenAIError
from producer.openai.protocol import ImagePart, ImageURL, Message, RefusalPart, TextPart

INSTRUCTIONS = ("system", "developer")
TURNS = {"user": "User", "assistant": "Assistant"}


@dataclass(frozen=True)
class Folded:
    prompt: str
    prompt_param: str  # where the prompt's text was, for errors about it
    image: ImageURL
    image_param: str  # where the image was
    conversation: bool = False  # instructions or earlier turns beside the question: never cut


def fold(messages: list[Message]) -> Folded:
    """The conversation's prompt and its one image; OpenAIError (400) naming the message otherwise."""
    if not messages:
        raise OpenAIError(400, "messages must hold at least the user's question", "messages", "invalid_value")
    last = len(messages) - 1
    if messages[last].role != "user":
        raise OpenAIError(
            400,
            f"the last message must be the user's question; the last is {messages[last].role!r}",
            f"messages[{last}].role",
            "unsupported_value",
        )
    instructions: list[str] = []
    history: list[str] = []
    image: tuple[ImageURL, str] | None = None
    for index, message in enumerate(messages):
        text, found = _read(message, index)
        if found is not None:
            if image is not None:
                raise OpenAIError(
                    400,
                    f"one image per request: {image[1]} is the photo this conversation is about; "
                    f"{found[1]} is a second (send each photo in its own request)",
                    found[1],
                    "too_many_images",
                )
            image = found
        if not text.strip():
            continue  # a message with no text (only the photo, or blanks) adds no line
        if message.role in INSTRUCTIONS:
            instructions.append(text)
        elif index < last:
            history.append(f"{TURNS[message.role]}: {text}")
    if image is None:
        raise OpenAIError(
            400,
            "no image: mrc answers questions about a photo; put one image_url part in a user message",
            "messages",
            "image_required",
        )
    question, question_param = _read(messages[last], last)[0], _text_param(messages[last], last)
    blocks = ["\n".join(instructions), "\n".join(history), question if question.strip() else ""]
    prompt = "\n\n".join(block for block in blocks if block)
    param = question_param if len(messages) == 1 else "messages"
    return Folded(prompt, param, image[0], image[1], bool(instructions or history))


def _read(message: Message, index: int) -> tuple[str, tuple[ImageURL, str] | None]:
    """A message's text (its text parts, one per line) and its image part, if any (user messages only)."""
    where = f"messages[{index}]"
    _admitted(message, where)
    if message.content is None:
        if message.refusal is not None:  # an earlier answer that refused: the refusal is its text
            return message.refusal, None
        raise OpenAIError(
            400,
            f"{message.role!r} messages need content here (tool calls are not offered)",
            f"{where}.content",
            "invalid_value",
        )
    if isinstance(message.content, str):
        return message.content, None
    texts, image = [], None
    for part_index, part in enumerate(message.content):
        if isinstance(part, TextPart | RefusalPart):
            text = part.text if isinstance(part, TextPart) else part.refusal
            if text.strip():  # an empty part adds nothing, not an empty line
                texts.append(text)
        elif isinstance(part, ImagePart):
            param = f"{where}.content[{part_index}].image_url.url"
            if message.role != "user":
                raise OpenAIError(
                    400,
                    f"images come in user messages, not {message.role!r} ones",
                    param,
                    "unsupported_value",
                )
            if image is not None:
                raise OpenAIError(
                    400,
                    f"one image per request: {image[1]} is the photo this conversation is about; "
                    f"{param} is a second (send each photo in its own request)",
                    param,
                    "too_many_images",
                )
            image = (part.image_url, param)
    return "\n".join(texts), image


def _admitted(message: Message, where: str) -> None:
    """OpenAIError for a role mrc does not take, or what an earlier answer may carry besides its text
    and mrc does not offer: empty tool calls and annotations (kept out of the prompt) pass; a tool
    call, a function call or audio is refused by name, and a refusal, a parsed answer or annotations
    anywhere but an assistant's."""
    if message.role not in (*INSTRUCTIONS, *TURNS):
        raise OpenAIError(
            400,
            f"{message.role!r} messages are not taken (tools and functions are not offered): system, "
            "developer, user and assistant are",
            f"{where}.role",
            "unsupported_value",
        )
    offered = {
        "tool_calls": bool(message.tool_calls),
        "function_call": message.function_call is not None,
        "audio": message.audio is not None,
        "tool_call_id": message.tool_call_id is not None,
    }
    for field, present in offered.items():
        if present:
            raise OpenAIError(
                400,
                f"{where}.{field}: tools, functions and audio are not offered (a conversation of text "
                "and one photo is)",
                f"{where}.{field}",
                "unsupported_value",
            )
    parts = message.content if isinstance(message.content, list) else []
    refusals = [f"{where}.content[{i}]" for i, p in enumerate(parts) if isinstance(p, RefusalPart)]
    refusals += [f"{where}.refusal"] if message.refusal is not None else []
    refusals += [f"{where}.parsed"] if message.parsed is not None else []  # an answer's, as a refusal
    refusals += [f"{where}.annotations"] if message.annotations is not None else []
    if refusals and message.role != "assistant":
        raise OpenAIError(
            400,
            f"a refusal, a parsed answer or annotations are an assistant's, not {message.role!r}",
            refusals[0],
            "unsupported_value",
        )


def _text_param(message: Message, index: int) -> str:
    """Where the question's text is: its one text part when it has one, else the message's content."""
    if isinstance(message.content, list):
        texts = [i for i, p in enumerate(message.content) if isinstance(p, TextPart)]
        if len(texts) == 1:
            return f"messages[{index}].content[{texts[0]}].text"
    return f"messages[{index}].content"
