"""Only valid UTF-8 in a constrained answer, whatever the grammar library lets through.

The grammar library (xgrammar 0.2.9) matches characters byte by byte, and some byte sequences it
accepts are not text: surrogates (ED A0-BF ..), overlong forms (E0 80-9F .., F0 80-8F ..), code points
past U+10FFFF (F4 90-BF .., F5-FF), and the lead bytes C0 and C1 that only start overlong forms. The
tokenizer decodes such a run (with the byte tokens beside it, a closing quote included) to U+FFFD and
the answer no longer parses (tests/unit/test_schema_rules.py found surrogates and overlong forms).
A byte-fallback vocabulary (Fuyu's) writes them only with single-byte tokens; so a row's mask is
narrowed: tokens holding a byte that never occurs in UTF-8 are never allowed, and after a token that
ends in one of the lead bytes E0, ED, F0, F4, the tokens starting with that lead's forbidden second
bytes are not either.
"""

from __future__ import annotations

from typing import Any

_NEVER = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})
# A lead byte -> the second bytes that make its sequence invalid.
_AFTER = {0xE0: range(0x80, 0xA0), 0xED: range(0xA0, 0xC0), 0xF0: range(0x80, 0x90), 0xF4: range(0x90, 0xC0)}


class Utf8Guard:
    def __init__(self, decoded_vocab: list[bytes], vocab_size: int) -> None:
        never = [i for i, raw in enumerate(decoded_vocab) if _NEVER.intersection(raw)]
        self.always = _keep(never, vocab_size)
        self.after: dict[int, Any] = {}
        for lead, seconds in _AFTER.items():
            starting = [i for i, raw in enumerate(decoded_vocab) if raw[:1] and raw[0] in seconds]
            self.after[lead] = self.always & _keep(starting, vocab_size)
        self._lead = {i: raw[-1] for i, raw in enumerate(decoded_vocab) if raw and raw[-1] in _AFTER}

    def keep_after(self, token: int) -> Any:
        """The mask row (32-bit words, set bits allowed) to AND into the row's next mask."""
        lead = self._lead.get(token)
        return self.always if lead is None else self.after[lead]


def _keep(tokens: list[int], vocab_size: int) -> Any:
    """A bitmask row with every bit set but those of `tokens`."""
    import torch

    keep = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)
    for token in tokens:
        if token < vocab_size:  # int32 words: bit 31 is the sign bit
            keep[token // 32] &= ~(1 << (token % 32)) if token % 32 < 31 else 0x7FFFFFFF
    return keep
