"""The structured-answer mask at Fuyu-8B's vocabulary size (262,144 tokens), through the worker's own
grammar code (workers/grammar.py, workers/engine/masks.py), logits on the device.

Fuyu-8B's tokenizer comes with its weights, which cannot be downloaded: the vocabulary here is
synthetic (a Unigram tokenizer with byte fallback, like Fuyu's: specials, the 256 byte tokens, then
deterministic pseudo-random pieces of 2-12 characters, half of them word-initial "▁..." pieces, some
non-ASCII). A mask's fill cost depends on how many tokens the grammar must check at a state, which a
synthetic vocabulary of the same size and kind approximates; it is not Fuyu's own.

Reported: the vocabulary's set-up (the tokenizer info, the compiler, the UTF-8 guard), compile times
per schema (cold and cached), and per decode step at 16 and 64 rows, each row at the same grammar
state (the answer's start; inside a free string): the mask's fill (CPU, xgrammar's batch fill) and its
application to the logits on the device, in milliseconds.

    python tests/bench/bench_grammar_vocab.py [--device cuda] [--rows 16,64] [--vocab 262144] [--json F]
    python tests/bench/bench_grammar_vocab.py --smoke      # the CPU, fewer repeats
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after sys.path is set

from shared import response_format as rf  # noqa: E402 - after sys.path is set
from tests.bench.bench_structured import CHOICES, NESTED, REFUND  # noqa: E402 - after sys.path is set
from workers.engine import masks  # noqa: E402 - after sys.path is set
from workers.grammar import Grammars  # noqa: E402 - after sys.path is set

EOS = "|ENDOFTEXT|"
# The states a row's mask is measured at: the text its answer holds so far.
STATES = {"start": "", "in_string": '{"refund": true, "damage": "crushed", "reason": "box t'}
CHARACTERS = (
    string.ascii_lowercase * 4
    + string.ascii_uppercase
    + string.digits
    + string.punctuation
    + "éüñßøçжи中文日本"
)


def synthetic_tokenizer(size: int) -> Any:
    """A Unigram tokenizer with byte fallback and exactly `size` entries."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<pad>", "<unk>", "<s>", EOS, "▁", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += [c for c in string.printable.strip() if c not in pieces]
    seen, rng = set(pieces), random.Random(0)
    while len(pieces) < size:
        piece = "".join(rng.choice(CHARACTERS) for _ in range(rng.randint(2, 12)))
        piece = "▁" + piece if rng.random() < 0.5 else piece
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    vocab = [(piece, -20.0 if piece.startswith("<0x") else -float(len(piece))) for piece in pieces]
    tok = Tokenizer(models.Unigram(vocab, unk_id=1, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", EOS)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token=EOS, unk_token="<unk>", pad_token="<pad>"
    )


def tokens_of(constraint: Any, text: str, by_bytes: dict[bytes, int]) -> list[int]:
    """Feed the row the tokens of `text`, each the longest piece its grammar allows there; returns them."""
    rest, taken = text.encode(), []
    while rest:
        mask = masks.for_rows([constraint])[0]
        for length in range(min(len(rest), 48), 0, -1):
            token = by_bytes.get(rest[:length])
            if token is not None and (int(mask[token // 32]) >> (token % 32)) & 1:
                constraint.accept(token)
                taken.append(token)
                rest = rest[length:]
                break
        else:
            raise RuntimeError(f"no allowed token starts {rest[:12]!r}")
    return taken


def step_ms(constraints: list[Any], vocab: int, device: str, repeats: int) -> dict[str, float]:
    """Median milliseconds of one step's fill (all rows) and of its application to the logits."""
    logits = torch.randn(len(constraints), vocab, device=device, dtype=torch.bfloat16)
    fills, applies = [], []
    for _ in range(repeats + 2):
        began = time.perf_counter()
        mask = masks.for_rows(constraints)
        filled = time.perf_counter()
        masks.apply(logits, mask)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        fills.append((filled - began) * 1000)
        applies.append((time.perf_counter() - filled) * 1000)
    fill, apply = statistics.median(fills[2:]), statistics.median(applies[2:])
    return {"fill_ms": round(fill, 3), "apply_ms": round(apply, 3), "step_ms": round(fill + apply, 3)}


# A wide object: 150 required properties (strings, integers, enums), ~7 KB of schema
WIDE = {
    "type": "json_schema",
    "schema": {
        "type": "object",
        "properties": {
            f"p{j}": (
                {"type": "string", "maxLength": 30}
                if j % 3 == 0
                else {"type": "integer"}
                if j % 3 == 1
                else {"enum": [f"x{j}", f"y{j}"]}
            )
            for j in range(150)
        },
        "required": [f"p{j}" for j in range(150)],
        "additionalProperties": False,
    },
}


def compiles(grammars: Grammars) -> dict[str, dict[str, float]]:
    """Each format's compile, cold and cached, and what its grammar weighs kept."""
    out = {}
    for name, fmt in (("refund", REFUND), ("nested", NESTED), ("choice_64", CHOICES), ("wide_150", WIDE)):
        parsed = rf.parse(fmt)
        held = grammars.held_bytes
        cold = grammars.constraint(parsed)[1] or 0.0
        began = time.perf_counter()
        grammars.constraint(parsed)
        cached = time.perf_counter() - began
        out[name] = {
            "cold": round(cold * 1000, 1), "cached": round(cached * 1000, 3),
            "kept_mb": round((grammars.held_bytes - held) / 2**20, 2),  # what MRC_GRAMMAR_CACHE_BYTES counts
            "schema_bytes": len(json.dumps(fmt, separators=(",", ":"))),
        }  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--rows", default="16,64")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="the CPU, 5 repeats")
    parser.add_argument("--compile-only", action="store_true", help="compile times and sizes alone")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.repeats = "cpu", 5
    figures: dict[str, Any] = {"device": args.device, "vocab": args.vocab, "synthetic_vocabulary": True}
    began = time.perf_counter()
    tokenizer = synthetic_tokenizer(args.vocab)
    figures["tokenizer_build_s"] = round(time.perf_counter() - began, 2)
    began = time.perf_counter()
    grammars = Grammars(tokenizer, args.vocab, tokenizer.convert_tokens_to_ids(EOS), keep=8)
    figures["grammar_setup_s"] = round(time.perf_counter() - began, 2)
    print(f"vocabulary {args.vocab}: {figures['tokenizer_build_s']} s, set-up {figures['grammar_setup_s']} s")
    figures["compile_ms"] = compiles(grammars)
    print(f"compile: {figures['compile_ms']}", flush=True)
    if args.compile_only:
        return
    by_bytes: dict[bytes, int] = {}
    for index, piece in enumerate(grammars.info.decoded_vocab):
        by_bytes.setdefault(bytes(piece), index)
    refund = rf.parse(REFUND)
    figures["steps"] = []
    for rows in (int(r) for r in args.rows.split(",")):
        for state, text in STATES.items():
            constraints = [grammars.constraint(refund)[0] for _ in range(rows)]
            tokens = tokens_of(constraints[0], text, by_bytes)
            for constraint in constraints[1:]:
                for token in tokens:
                    constraint.accept(token)
            row = {
                "rows": rows,
                "state": state,
                "tokens_fed": len(tokens),
                **step_ms(constraints, args.vocab, args.device, args.repeats),
            }
            figures["steps"].append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                args.json.write_text(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
