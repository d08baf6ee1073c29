"""Train the `parcels` model: a tiny Fuyu (Fuyu-8B's architecture) that answers questions about the
synthetic parcel photos of scripts/parcels.py. CPU only, deterministic from its seed (on one machine
and thread count), run once; its output is committed in workers/models/parcels/.

    .venv/bin/python scripts/train_parcels.py                  # the committed run
    .venv/bin/python scripts/train_parcels.py --steps 200 --out /tmp/p   # a quick look

What it does, and why (docs/benchmarks.md, "The parcels model", has the figures):
- builds the tokenizer, FuyuProcessor and a FuyuForCausalLM from a FuyuConfig, seeded;
- checks, before training, that its inputs equal FuyuProcessor's for a few images (ids exactly,
  pixels within 1/255), so the model learns what the processor (and the worker) serves;
- trains on fresh images every step (no image is seen twice), one image size per batch and as many
  rows as fit a token budget, sizes drawn from the whole world with small ones more often (they are
  cheap and the label's glyph is large in them), questions drawn per row;
- adds per-patch targets on a middle layer (see scripts/parcels_batches.py), whose heads are
  dropped at the end: the model saved is a plain FuyuForCausalLM;
- prints held-out accuracy per question kind (images from seeds no training batch draws) and saves
  with save_pretrained; then reloads with from_pretrained and checks the answers are unchanged.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import parcels  # noqa: E402
from scripts import parcels_batches as pb  # noqa: E402
from scripts.parcels_training import (  # noqa: E402
    HELD_OUT_SEED,
    KIND_WEIGHTS,
    Batches,
    PatchHeads,
    answer_logits,
    dct_embedding,
    evaluate,
)
from workers.backends.tiny import build_processor, config_fields  # noqa: E402

OUT = ROOT / "workers" / "models" / "parcels"


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--token-budget", type=int, default=6000, help="positions per batch")
    parser.add_argument("--max-rows", type=int, default=32)
    parser.add_argument("--aux", type=float, default=0.5, help="weight of the per-patch targets")
    parser.add_argument("--held-out", type=int, default=400, help="images of the final evaluation")
    parser.add_argument("--eval-every", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: best beside other work)")
    parser.add_argument("--max-minutes", type=float, default=0, help="stop early past this (0: never)")
    parser.add_argument("--embed-init", choices=("dct", "random"), default="dct")
    parser.add_argument("--small-until", type=float, default=0.15, help="share of steps on small photos only")
    parser.add_argument("--loaders", type=int, default=1, help="processes drawing batches")
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast (5x slower with AMX)")
    return parser.parse_args()


def build(out: Path, args: argparse.Namespace) -> tuple[Any, Any]:
    from transformers import FuyuConfig, FuyuForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    processor, vocab_size = build_processor(out, pb.pieces())
    tokenizer = processor.tokenizer
    sizes = dict(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        max_position_embeddings=4096,
    )
    torch.manual_seed(args.seed)
    model = FuyuForCausalLM(FuyuConfig(**config_fields(tokenizer, vocab_size, **sizes)))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return processor, model


def check_against_processor(processor: Any, batcher: pb.Batcher) -> None:
    """Our rows against FuyuProcessor's for a few images: the ids exactly, the pixels within 1/255."""
    import io

    from PIL import Image

    for seed in (1, 2, 3, 4):
        data, truth = parcels.make(HELD_OUT_SEED - seed)
        prompt = parcels.question(seed, "colour")
        ref = processor(
            text=[prompt],
            images=[Image.open(io.BytesIO(data)).convert("RGB")],
            return_tensors="pt",
            return_legacy_image_output=False,
        )
        ours = batcher.build([(data, truth, "colour", prompt)])
        prefix = ours.input_ids[0, : ours.answer_pos[0] + 1]
        if not torch.equal(ref["input_ids"][0], prefix):
            raise SystemExit(f"input ids differ from FuyuProcessor's for held-out image {seed}")
        diff = float((ref["pixel_values"] - ours.pixel_values).abs().max()) * 127.5
        if diff > 1.0:
            raise SystemExit(f"pixels differ from FuyuProcessor's by {diff:.2f}/255 for image {seed}")


def optimiser(params: list[nn.Parameter], args: argparse.Namespace) -> tuple[Any, Any]:
    """AdamW (no decay on norms and biases), a linear warm-up, then a cosine down to 5 %."""
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    warmup = min(300, args.steps // 10)

    def rate(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    return adamw, torch.optim.lr_scheduler.LambdaLR(adamw, rate)


class Progress:
    """What the log line says: speed, running losses, first-token accuracy on the training rows."""

    def __init__(self) -> None:
        self.began = time.monotonic()
        self.samples = self.tokens = 0
        self.running = {"answer": 0.0, "patch": 0.0}
        self.window = dict.fromkeys(KIND_WEIGHTS, (0, 0))

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def add(self, batch: pb.Batch, logits: torch.Tensor, answer: float, patch: float) -> None:
        self.samples += batch.input_ids.shape[0]
        self.tokens += batch.tokens
        self.running["answer"] = 0.98 * self.running["answer"] + 0.02 * answer
        self.running["patch"] = 0.98 * self.running["patch"] + 0.02 * patch
        hits = (logits.argmax(-1) == batch.answer_ids)[batch.first].tolist()
        for kind, hit in zip(batch.kinds, hits, strict=True):
            self.window[kind] = (self.window[kind][0] + hit, self.window[kind][1] + 1)

    def line(self, step: int, heads: PatchHeads, rate: float) -> str:
        elapsed = self.elapsed
        accuracy = " ".join(f"{k} {h / max(1, n):.2f}" for k, (h, n) in self.window.items())
        self.window = dict.fromkeys(KIND_WEIGHTS, (0, 0))
        return (
            f"step {step} | {elapsed / 60:.1f} min | {self.samples / elapsed:.1f} samples/s | "
            f"{self.tokens / elapsed:.0f} positions/s | loss answer {self.running['answer']:.3f} "
            f"patch {self.running['patch']:.3f} ({'/'.join(f'{p:.2f}' for p in heads.parts)}) | "
            f"train {accuracy} | lr {rate:.2e}"
        )

    def record(self, step: int, accuracy: dict[str, float]) -> dict[str, Any]:
        return {"step": step, "minutes": round(self.elapsed / 60, 2), "samples": self.samples, **accuracy}


def train(model: Any, batcher: pb.Batcher, args: argparse.Namespace) -> dict[str, Any]:
    heads = PatchHeads(args.hidden)
    params = [*model.parameters(), *heads.parameters()]
    adamw, schedule = optimiser(params, args)
    batches = torch.utils.data.DataLoader(
        Batches(batcher.tokenizer, args),
        batch_size=None,
        num_workers=args.loaders,
        prefetch_factor=4 if args.loaders else None,
    )
    middle = args.layers // 2
    model.train()
    progress = Progress()
    history = []
    step = 0
    for step, batch in enumerate(batches, start=1):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.fp32):
            logits, out = answer_logits(model, batch, hidden_states=True)
            answer = nn.functional.cross_entropy(logits, batch.answer_ids)
            patch = heads.loss(out.hidden_states[middle], out.last_hidden_state, batch)
        # Per-patch targets weigh less as the answers take over.
        loss = answer + args.aux * (1 - 0.8 * (step - 1) / args.steps) * patch
        adamw.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        adamw.step()
        schedule.step()
        progress.add(batch, logits, answer.item(), patch.item())
        if step % 50 == 0:
            print(progress.line(step, heads, schedule.get_last_lr()[0]), flush=True)
            if args.max_minutes and progress.elapsed > 60 * args.max_minutes:  # a crowded machine
                print(f"stopping at step {step}: over --max-minutes {args.max_minutes}", flush=True)
                break
        if step % args.eval_every == 0 and step < args.steps:
            history.append(progress.record(step, evaluate(model, batcher, args.held_out // 4, not args.fp32)))
            print("held-out", json.dumps(history[-1]), flush=True)
    minutes = round(progress.elapsed / 60, 2)
    cpu_minutes = round(time.process_time() / 60, 2)  # this process: what a machine of its own would take
    history.append(progress.record(step, evaluate(model, batcher, args.held_out)))
    print("held-out (fp32)", json.dumps(history[-1]), flush=True)
    return {
        "minutes": minutes,
        "cpu_minutes": cpu_minutes,
        "steps": step,
        "samples": progress.samples,
        "samples_per_s": round(progress.samples / (60 * minutes), 1),
        "positions_per_s": round(progress.tokens / (60 * minutes)),
        "history": history,
    }


def save_and_check(
    model: Any, processor: Any, batcher: pb.Batcher, out: Path, report: dict[str, Any]
) -> None:
    """save_pretrained, then from_pretrained: the reloaded model must answer exactly as the trained one."""
    from transformers import FuyuForCausalLM

    model.eval()
    model.save_pretrained(out)
    processor.save_pretrained(out)
    reloaded = FuyuForCausalLM.from_pretrained(out, local_files_only=True).eval()
    with torch.no_grad():
        for i in range(8):
            data, truth = parcels.make(HELD_OUT_SEED + i)
            batch = batcher.build([(data, truth, k, parcels.question(i, k)) for k in parcels.KINDS])
            a, _ = answer_logits(model, batch)
            b, _ = answer_logits(reloaded, batch)
            if not torch.equal(a.argmax(-1), b.argmax(-1)):
                raise SystemExit("the reloaded model answers differently")
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n")


def main() -> int:
    args = arguments()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    processor, model = build(args.out, args)
    batcher = pb.Batcher(processor.tokenizer)
    check_against_processor(processor, batcher)
    if args.embed_init == "dct":
        samples = [(*parcels.make(HELD_OUT_SEED - 100 - i, (640, 480)), "colour", "") for i in range(4)]
        dct_embedding(
            model, batcher.build([(d, t, k, parcels.QUESTIONS["colour"][0]) for d, t, k, _ in samples])
        )
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {parameters / 1e6:.2f} M parameters; inputs equal FuyuProcessor's", flush=True)
    report: dict[str, Any] = {
        "arguments": {k: str(v) for k, v in vars(args).items()},
        "parameters": parameters,
    }
    report.update(train(model, batcher, args))
    save_and_check(model, processor, batcher, args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "history"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
