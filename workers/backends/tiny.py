"""Builds the tiny Fuyu: Fuyu-8B's architecture at toy size, random weights (seeded), built offline.

It is saved with save_pretrained into a local folder once, then loaded through the very same
from_pretrained code as Fuyu-8B (backends/fuyu.py), so tests and the demo exercise the real path.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

TINY_VERSION = "tiny-fuyu-v1"
_SEED = 1234
_WORDS = tuple(
    [
        "the",
        "a",
        "an",
        "is",
        "are",
        "was",
        "what",
        "where",
        "which",
        "who",
        "how",
        "can",
        "I",
        "get",
        "refund",
        "parcel",
        "box",
        "damaged",
        "broken",
        "photo",
        "image",
        "picture",
        "question",
        "answer",
        "customer",
        "order",
        "delivery",
        "package",
        "colour",
        "color",
        "red",
        "green",
        "blue",
        "text",
        "please",
        "help",
        "this",
        "that",
        "there",
        "of",
        "to",
        "in",
        "on",
        "for",
        "with",
        "and",
        "or",
        "not",
        "yes",
        "no",
    ]
)


def vocabulary(pieces: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """Unigram pieces: specials (pad id 0, as FuyuProcessor expects), byte fallback, chars, then
    `pieces` (a model's own words), duplicates dropped."""
    base: list[tuple[str, float]] = [
        ("<pad>", 0.0),
        ("<unk>", 0.0),
        ("<s>", 0.0),
        ("|ENDOFTEXT|", 0.0),
        # Plain vocabulary entries, not special tokens: the processor relies on "▁" before them.
        ("|SPEAKER|", -1.0),
        ("|NEWLINE|", -1.0),
        ("▁", -2.0),
    ]
    base += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    base += [(chr(c), -8.0) for c in range(33, 127)]
    seen: set[str] = set()
    unique = []
    for piece, score in [*base, *pieces]:
        if piece not in seen:
            seen.add(piece)
            unique.append((piece, score))
    return unique


def build_tokenizer(folder: Path, pieces: list[tuple[str, float]]) -> int:
    """A Fuyu-compatible tokenizer (STACK-NOTES' pitfalls avoided) saved in `folder`; its size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary(pieces)
    ids = {piece: i for i, (piece, _) in enumerate(vocab)}
    tok = Tokenizer(models.Unigram(vocab, unk_id=ids["<unk>"], byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "|ENDOFTEXT|")])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="|ENDOFTEXT|",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(folder)
    return len(vocab)


def config_fields(tokenizer: Any, vocab_size: int, **sizes: Any) -> dict[str, Any]:
    """FuyuConfig fields of a toy Fuyu: Fuyu-8B's architecture (persimmon layers, relu2, qk layernorm,
    half rotary) at the sizes given, with the tokenizer's control ids."""
    fields: dict[str, Any] = dict(
        vocab_size=((vocab_size + 63) // 64) * 64,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=4096,
        hidden_act="relu2",
        qk_layernorm=True,
        partial_rotary_factor=0.5,
        image_token_id=tokenizer.convert_tokens_to_ids("|SPEAKER|"),
        pad_token_id=0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    fields.update(sizes)
    return fields


def build_processor(folder: Path, pieces: list[tuple[str, float]]) -> tuple[Any, int]:
    """Tokenizer and FuyuProcessor saved in `folder`: the processor and the tokenizer's size."""
    from transformers import FuyuImageProcessor, FuyuProcessor, PreTrainedTokenizerFast

    vocab_size = build_tokenizer(folder, pieces)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    processor = FuyuProcessor(image_processor=FuyuImageProcessor(), tokenizer=tokenizer)
    processor.save_pretrained(folder)
    return processor, vocab_size


def _build(folder: Path) -> None:
    import torch
    from transformers import FuyuConfig, FuyuForCausalLM

    processor, vocab_size = build_processor(folder, [("▁" + w, -4.0) for w in _WORDS])
    tokenizer = processor.tokenizer
    torch.manual_seed(_SEED)
    model = FuyuForCausalLM(FuyuConfig(**config_fields(tokenizer, vocab_size)))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    (folder / "mrc-tiny.json").write_text(json.dumps({"version": TINY_VERSION, "seed": _SEED}))


def ensure_tiny_model(home: str) -> Path:
    """The folder of the tiny Fuyu under `home`, building it first if it is not there yet.

    Built in a temporary folder and renamed into place, so concurrent workers never see half a model.
    """
    target = Path(home) / "models" / TINY_VERSION
    if (target / "mrc-tiny.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        _build(scratch)
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / "mrc-tiny.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
