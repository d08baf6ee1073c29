"""How a pattern's bounded repeat costs the grammar compile (issue 36, item 9): `^[a-z]{1,n}$` compiled
cold through the worker's own code (workers/grammar.py), for several n, on the parcels model's
vocabulary (448 tokens) and optionally on a synthetic one of Fuyu-8B's size (262,144 tokens; see
tests/bench/bench_grammar_vocab.py for how it is made). xgrammar spells such a repeat out once per
count, so the compile grows with n; what the worker does about it: docs/design.md, "Structured
answers" (bounds past max_new_tokens refused at submission, compiles off the delivery's path, with
MRC_GRAMMAR_COMPILE_TIMEOUT_S).

    python tests/bench/bench_grammar_repeats.py [--repeats 500,2000,10000] [--vocab 262144]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shared.response_format import JsonSchemaFormat  # noqa: E402 - after sys.path is set
from workers.grammar import Grammars  # noqa: E402 - after sys.path is set


def parcels_grammars() -> Grammars:
    from transformers import AutoConfig, AutoProcessor

    from workers.models import parcels_path

    path = parcels_path()
    tokenizer = AutoProcessor.from_pretrained(path, local_files_only=True).tokenizer
    vocab = AutoConfig.from_pretrained(path, local_files_only=True).text_config.vocab_size
    return Grammars(tokenizer, vocab, int(tokenizer.eos_token_id), keep=1)


def synthetic_grammars(size: int) -> Grammars:
    from tests.bench.bench_grammar_vocab import EOS, synthetic_tokenizer

    tokenizer = synthetic_tokenizer(size)
    return Grammars(tokenizer, size, tokenizer.convert_tokens_to_ids(EOS), keep=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--repeats", default="500,1000,2500,5000,10000,20000")
    parser.add_argument("--vocab", type=int, default=0, help="a synthetic vocabulary of this size too")
    args = parser.parse_args()
    vocabularies = [("parcels (448)", parcels_grammars)]
    if args.vocab:
        vocabularies.append((f"synthetic ({args.vocab:,})", lambda: synthetic_grammars(args.vocab)))
    print("| vocabulary | pattern | compile s | longest token (characters) |")
    print("|---|---|---|---|")
    for name, build in vocabularies:
        grammars = build()
        for n in (int(x) for x in args.repeats.split(",")):
            fmt = JsonSchemaFormat(
                type="json_schema", schema={"type": "string", "pattern": f"^[a-z]{{1,{n}}}$"}
            )
            began = time.perf_counter()
            grammars.compile(fmt)
            seconds = time.perf_counter() - began
            pattern = f"`^[a-z]{{1,{n}}}$`"
            print(f"| {name} | {pattern} | {seconds:.2f} | {grammars.longest_token_chars} |", flush=True)


if __name__ == "__main__":
    main()
