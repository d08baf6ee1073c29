"""The cost of structured answers on the engine: generated tokens/s of a batch whose rows are all
constrained against the same batch with none, measured side by side in one run, and the grammar
compile time per schema (cold, and cached).

Rows of both runs generate exactly `--new-tokens` tokens each, so the two runs do the same number of
decode steps: free rows ignore end-of-text (`exact_steps`), constrained rows follow a grammar that
cannot be complete within that many tokens (an array of at least 10,000 strings), so their mask is
computed and applied at every step. A second constrained run uses the refund schema of README.md,
whose rows end when their answer does (tokens/s over the tokens they generated).

    .venv/bin/python tests/bench/bench_structured.py [--rows 16] [--new-tokens 64] [--quantization fp32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after sys.path is set

from shared import response_format as rf  # noqa: E402 - after sys.path is set
from shared.settings import Settings  # noqa: E402 - after sys.path is set
from tests.support.refund import REFUND_SCHEMA  # noqa: E402 - after sys.path is set
from workers.backends.base import GenerationInput  # noqa: E402 - after sys.path is set
from workers.backends.fuyu import FuyuBackend  # noqa: E402 - after sys.path is set
from workers.engine import scheduler  # noqa: E402 - after sys.path is set
from workers.engine.engine import Engine  # noqa: E402 - after sys.path is set
from workers.engine.sequence import Sequence  # noqa: E402 - after sys.path is set
from workers.grammar import Grammars  # noqa: E402 - after sys.path is set

ENDLESS = {"type": "json_schema", "schema": {"type": "array", "items": {"type": "string"}, "minItems": 10000}}
REFUND = {"type": "json_schema", "schema": REFUND_SCHEMA}
NESTED = {
    "type": "json_schema",
    "schema": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 5,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "minLength": 4, "maxLength": 12},
                        "count": {"type": "integer", "minimum": 1, "maximum": 99},
                        "damaged": {"type": "boolean"},
                    },
                    "required": ["sku", "count", "damaged"],
                },
            },
            "carrier": {"enum": ["dhl", "ups", "fedex", "usps", "royal_mail", "other"]},
        },
        "required": ["items", "carrier"],
    },
}
CHOICES = {"type": "choice", "choices": [f"reason_{i:02d}" for i in range(64)]}


def items(rows: int, new_tokens: int) -> list[GenerationInput]:
    out = []
    for index in range(rows):
        height, width = [(48, 64), (90, 120), (120, 160)][index % 3]
        image = torch.full((3, height, width), (40 + 29 * index) % 256, dtype=torch.uint8)
        out.append(
            GenerationInput(image, ["Refund?", "What is damaged?", "Which carrier?"][index % 3], new_tokens)
        )
    return out


def run_engine(
    backend: FuyuBackend, jobs: list[GenerationInput], fmt: dict[str, Any] | None
) -> tuple[int, float]:
    """(tokens generated, seconds) for every job admitted at once and run to its end."""
    done: list[Sequence] = []
    engine = Engine(backend.step_model(len(jobs)), scheduler.Limits(len(jobs), 0), done.append)
    for index, item in enumerate(jobs):
        inputs, positions = backend.row_inputs(item)
        constraint = None if fmt is None else backend.grammars.constraint(rf.parse(fmt))[0]
        engine.submit(
            Sequence(str(index), inputs, positions, item.max_new_tokens, backend.eos_id,
                     exact_steps=fmt is None, constraint=constraint)
        )  # fmt: skip
    began = time.perf_counter()
    while not engine.idle:
        engine.step()
    if backend.device == "cuda":
        torch.cuda.synchronize()
    return sum(len(row.tokens) for row in done), time.perf_counter() - began


def overhead(backend: FuyuBackend, rows: int, new_tokens: int, repeats: int) -> dict[str, float]:
    """Tokens/s free vs all constrained, interleaved runs (the machine's drift hits both alike)."""
    jobs = items(rows, new_tokens)
    run_engine(backend, jobs[:2], ENDLESS)  # warm: kernels, the grammar compiled once
    rates: dict[str, list[float]] = {"free": [], "constrained": [], "refund": []}
    for _ in range(repeats):
        for name, fmt in (("free", None), ("constrained", ENDLESS), ("refund", REFUND)):
            tokens, seconds = run_engine(backend, jobs, fmt)
            rates[name].append(tokens / seconds)
    free, constrained = statistics.median(rates["free"]), statistics.median(rates["constrained"])
    return {
        "rows": rows,
        "new_tokens": new_tokens,
        "free_tokens_s": round(free, 1),
        "constrained_tokens_s": round(constrained, 1),
        "ratio": round(constrained / free, 3),
        "refund_tokens_s": round(statistics.median(rates["refund"]), 1),
    }


def mask_step_ms(backend: FuyuBackend, rows: int, repeats: int = 200) -> float:
    """One step's mask alone (fill for every row, apply to the logits), in milliseconds."""
    from workers.engine import masks

    constraints = [backend.grammars.constraint(rf.parse(REFUND))[0] for _ in range(rows)]
    logits = torch.randn(rows, backend.grammars.vocab_size, device=backend.device)
    began = time.perf_counter()
    for _ in range(repeats):
        masks.apply(logits, masks.for_rows(constraints))
    if backend.device == "cuda":
        torch.cuda.synchronize()
    return round((time.perf_counter() - began) / repeats * 1000, 3)


def compile_times(backend: FuyuBackend) -> dict[str, dict[str, float]]:
    """Milliseconds per schema: cold (a fresh compiler), cached (the second look-up)."""
    out = {}
    for name, fmt in (("refund", REFUND), ("nested", NESTED), ("choice_64", CHOICES)):
        grammars = Grammars(backend.processor.tokenizer, backend.grammars.vocab_size, backend.eos_id, keep=8)
        parsed = rf.parse(fmt)
        began = time.perf_counter()
        grammars.constraint(parsed)
        cold = time.perf_counter() - began
        began = time.perf_counter()
        grammars.constraint(parsed)
        cached = time.perf_counter() - began
        out[name] = {"cold_ms": round(cold * 1000, 2), "cached_ms": round(cached * 1000, 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quantization", default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny", help="tiny, or a local Fuyu folder")
    args = parser.parse_args()
    backend = FuyuBackend(
        Settings(model=args.model, quantization=args.quantization, device=args.device,
                 home=str(ROOT / ".cache" / "mrc"))
    )  # fmt: skip
    backend.load()
    figures = {
        "model": backend.model_id,
        "quantization": args.quantization,
        "device": backend.device,
        "overhead": overhead(backend, args.rows, args.new_tokens, args.repeats),
        "mask_step_ms": mask_step_ms(backend, args.rows),
        "compile": compile_times(backend),
    }
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
