"""User text must never become the model's control tokens.

Fuyu's input is built from control tokens (the image placeholder `|SPEAKER|`, the row marker
`|NEWLINE|`, `<s>`, the beginning-of-answer `<0x04>`, the end of text); a tokenizer turns their text,
typed into a prompt, into the very same ids. A prompt holding one broke its whole model batch
("Image features and image tokens do not match") or could end the question early. Each such text is
replaced by a look-alike that no tokenizer reads as a control token, keeping the prompt's length:
`|` -> `¦`, `<` -> `‹`, `>` -> `›`, a control character -> U+FFFD. The producer does this to what it
sends, and the worker again, with its tokenizer's own list, to whatever it receives, then checks the
token ids themselves (workers/backends/fuyu.py). Torch-free: the producer uses it.
"""

from __future__ import annotations

from collections.abc import Iterable

# Fuyu's control tokens as text, and the one control character whose byte token is one of them
# (byte fallback turns U+0004 into <0x04>, the beginning-of-answer token).
FUYU_CONTROL_TEXT: tuple[str, ...] = (
    "|SPEAKER|",
    "|NEWLINE|",
    "|ENDOFTEXT|",
    "<s>",
    "</s>",
    "<unk>",
    "<pad>",
    "<0x04>",
    "\x04",
)
_LOOKALIKES = str.maketrans({"|": "\u00a6", "<": "\u2039", ">": "\u203a"})
_JOINER = "\u2060"  # word joiner: splits a control text that has none of the characters above


def defuse(control: str) -> str:
    """A look-alike of one control token's text that no longer tokenizes as it."""
    swapped = control.translate(_LOOKALIKES)
    if swapped != control:
        return swapped
    if len(control) == 1:
        return "\ufffd"
    return control[0] + _JOINER + control[1:]


def neutralise(prompt: str, controls: Iterable[str] = FUYU_CONTROL_TEXT) -> str:
    """The prompt with every control token's text defused (longest first, so `</s>` before `<s>`)."""
    for control in sorted(set(controls), key=len, reverse=True):
        if control and control in prompt:
            prompt = prompt.replace(control, defuse(control))
    return prompt
