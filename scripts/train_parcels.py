"""Train the `parcels` model: a tiny Fuyu (Fuyu-8B's architecture) that answers questions about the
synthetic parcel photos of scripts/parcels.py. CPU only, deterministic from its seed (on one machine
and thread count), run once; its output is committed in workers/models/parcels/.

    .venv/bin/python scripts/train_parcels.py                  # the committed run
    .venv/bin/python scripts/train_parcels.py --steps 200 --out /tmp/p   # a quick look

What it does, and why (docs/parcels-model.md has the figures):
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
import os
import random
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
from workers.backends.tiny import build_processor, config_fields  # noqa: E402

OUT = ROOT / "workers" / "models" / "parcels"
# Seeds: training images draw theirs from [10^9, 2 x 10^9); every seed below 10^9 is free for held-out
# sets, tests, demos and benchmarks (this script's held-out set starts at 900,000,000).
TRAIN_SEEDS = (1_000_000_000, 2_000_000_000)
HELD_OUT_SEED = 900_000_000
KIND_WEIGHTS = {"colour": 0.12, "damage": 0.34, "digit": 0.34, "json": 0.20}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--token-budget", type=int, default=6000, help="positions per batch")
    parser.add_argument("--max-rows", type=int, default=32)
    parser.add_argument("--aux", type=float, default=0.5, help="weight of the per-patch targets")
    parser.add_argument("--held-out", type=int, default=300, help="images per evaluation")
    parser.add_argument("--eval-every", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--embed-init", choices=("dct", "random"), default="dct")
    parser.add_argument("--small-until", type=float, default=0.15, help="share of steps on small photos only")
    parser.add_argument("--loaders", type=int, default=1, help="processes drawing batches")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast for the forward pass")
    return parser.parse_args()


def _binary(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """BCE over the targets that are not -1; positives weigh 5x (a line crosses few patches)."""
    keep = target >= 0
    if not keep.any():
        return logits.sum() * 0
    weight = torch.tensor(5.0)
    return nn.functional.binary_cross_entropy_with_logits(logits[keep], target[keep], pos_weight=weight)


def _digits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """CE over the patches with a digit, plus a fifth of it over those with none."""
    loss = logits.sum() * 0
    ink = (target >= 0) & (target < pb.NO_DIGIT)
    blank = target == pb.NO_DIGIT
    if ink.any():
        loss = loss + nn.functional.cross_entropy(logits[ink], target[ink])
    if blank.any():
        loss = loss + 0.2 * nn.functional.cross_entropy(logits[blank], target[blank])
    return loss


class PatchHeads(nn.Module):
    """Per-patch classifiers, training only: what each patch shows, on a middle layer's states; and
    what the photo has shown up to each patch, on the last layer's (scripts/parcels_batches.py)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.region = nn.Linear(hidden, pb.REGIONS)
        self.line = nn.Linear(hidden, 1)
        self.digit = nn.Linear(hidden, pb.NO_DIGIT + 1)
        self.line_so_far = nn.Linear(hidden, 1)
        self.digit_so_far = nn.Linear(hidden, pb.NO_DIGIT + 1)
        self.parts: tuple[float, ...] = ()

    def loss(self, middle: torch.Tensor, last: torch.Tensor, batch: pb.Batch) -> torch.Tensor:
        h = middle[:, batch.patch_pos].float()  # [rows, patches, hidden]
        top = last[:, batch.patch_pos].float()
        parts = (
            nn.functional.cross_entropy(self.region(h).flatten(0, 1), batch.region.flatten()),
            _binary(self.line(h).squeeze(-1), batch.line),
            _digits(self.digit(h), batch.digit),
            _binary(self.line_so_far(top).squeeze(-1), batch.line_so_far),
            _digits(self.digit_so_far(top), batch.digit_so_far),
        )
        self.parts = tuple(float(p) for p in parts)
        return sum(parts, start=h.sum() * 0)


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


def dct_embedding(model: Any, batch: pb.Batch) -> None:
    """Start the patch embedding (a linear map of the 30 x 30 x 3 pixels) from what a photo is made
    of instead of noise: the mean colour of each 10 x 10 block (27 dimensions), and the 2-D cosine
    basis of the patch's brightness, low frequencies first, without the constant one (the rest). A
    thin dark line or a glyph's stroke is energy in those cosine terms, which the relu2 MLP after it
    can square and sum; from random projections it first has to find them. One scale for the whole
    map, so its outputs spread as the default initialisation's do."""
    import numpy as np

    embed = model.model.vision_embed_tokens
    hidden = embed.out_features
    size = 30
    rows = []
    for by in range(3):
        for bx in range(3):
            for channel in range(3):
                w = np.zeros((size, size, 3))
                w[by * 10 : by * 10 + 10, bx * 10 : bx * 10 + 10, channel] = 1 / 100
                rows.append(w.reshape(-1))
    grid = np.arange(size)
    frequencies = sorted(((u, v) for u in range(size) for v in range(size) if (u, v) != (0, 0)),
                         key=lambda uv: (uv[0] + uv[1], uv[0]))  # fmt: skip
    for u, v in frequencies[: hidden - len(rows)]:
        basis = np.outer(np.cos(np.pi * (grid + 0.5) * u / size), np.cos(np.pi * (grid + 0.5) * v / size))
        basis /= np.linalg.norm(basis)
        rows.append(np.repeat(basis[:, :, None] / 3, 3, axis=2).reshape(-1))
    weight = torch.tensor(np.stack(rows), dtype=torch.float32)
    with torch.no_grad():
        scale = 0.5 / float((batch.pixel_values @ weight.T).std())
        embed.weight.copy_(weight * scale)
        embed.bias.zero_()


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


class Batches(torch.utils.data.Dataset[pb.Batch]):
    """Step k's batch, drawn from its own seed: the same batches whichever process draws them."""

    def __init__(self, tokenizer: Any, args: argparse.Namespace) -> None:
        self.tokenizer = tokenizer
        self.args = args
        self.batcher: pb.Batcher | None = None

    def __len__(self) -> int:
        return int(self.args.steps)

    def widest(self, step: int, rng: random.Random) -> int:
        """The curriculum of sizes: small photos first (few patches: what to look at is easy to find,
        and each costs little), the cap growing to the world's widest by 60 % of the steps; then a
        third of the batches from the whole world, the rest no wider than 320-640 px."""
        progress = step / max(1, self.args.steps)
        if progress < self.args.small_until:
            return 320
        if progress < 0.6:
            grown = (progress - self.args.small_until) / (0.6 - self.args.small_until)
            return rng.randint(320, 320 + round(grown * (parcels.MAX_W - 320)))
        return parcels.MAX_W if rng.random() < 0.34 else rng.choice((320, 480, 640))

    def __getitem__(self, step: int) -> pb.Batch:
        if self.batcher is None:
            torch.set_num_threads(1)
            self.batcher = pb.Batcher(self.tokenizer)
        rng = random.Random(self.args.seed * 1_000_003 + step)
        width, height = parcels.sample_size(rng, self.widest(step, rng))
        positions = math.ceil(height / 30) * (math.ceil(width / 30) + 1) + 24
        rows = max(2, min(self.args.max_rows, self.args.token_budget // positions))
        samples = []
        for _ in range(rows):
            image, truth = parcels.make_pixels(rng.randrange(*TRAIN_SEEDS), (width, height))
            weights = json.loads(os.environ.get("PARCELS_KINDS", "null")) or KIND_WEIGHTS
            kind = rng.choices(list(weights), weights=list(weights.values()))[0]
            samples.append((image, truth, kind, self.batcher.prompt_for(rng, kind)))
        return self.batcher.build(samples)


def answer_logits(model: Any, batch: pb.Batch, hidden_states: bool = False) -> tuple[torch.Tensor, Any]:
    out = model.model(
        input_ids=batch.input_ids, pixel_values=batch.pixel_values, output_hidden_states=hidden_states
    )
    chosen = out.last_hidden_state[batch.answer_rows, batch.answer_pos]
    return model.lm_head(chosen).float(), out


@torch.no_grad()
def evaluate(model: Any, batcher: pb.Batcher, count: int, bf16: bool = False) -> dict[str, float]:
    """Held-out accuracy of the first answer token per kind (one token answers colour, damage and the
    digit), and of the JSON answer's three values with the answer so far given (teacher-forced)."""
    model.eval()
    right: dict[str, int] = {}
    seen: dict[str, int] = {}
    for i in range(count):
        data, truth = parcels.make(HELD_OUT_SEED + i)
        samples = [(data, truth, kind, parcels.question(i, kind)) for kind in parcels.KINDS]
        samples.append((data, truth, "json", parcels.JSON_PROMPT))
        batch = batcher.build(samples)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            predicted = answer_logits(model, batch)[0].argmax(-1)
        hits = predicted == batch.answer_ids
        for row, kind in enumerate(batch.kinds):
            mine = batch.answer_rows == row
            if kind == "json":  # the value tokens: pieces 1, 3 and 5 of the seven
                values = hits[mine][[1, 3, 5]].tolist()
                for name, ok in zip(("json.colour", "json.damaged", "json.digit"), values, strict=True):
                    right[name] = right.get(name, 0) + int(ok)
            else:
                ok = int(hits[mine & batch.first].item())
                right[kind] = right.get(kind, 0) + ok
                bucket = "small" if truth.width * truth.height <= 400 * 300 else "large"
                right[f"{kind}@{bucket}"] = right.get(f"{kind}@{bucket}", 0) + ok
                seen[f"{kind}@{bucket}"] = seen.get(f"{kind}@{bucket}", 0) + 1
    model.train()
    return {k: round(v / seen.get(k, count), 3) for k, v in sorted(right.items())}


def train(model: Any, batcher: pb.Batcher, args: argparse.Namespace) -> dict[str, Any]:
    heads = PatchHeads(args.hidden)
    params = [*model.parameters(), *heads.parameters()]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    optimiser = torch.optim.AdamW(
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

    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, rate)
    batches = torch.utils.data.DataLoader(
        Batches(batcher.tokenizer, args),
        batch_size=None,
        num_workers=args.loaders,
        prefetch_factor=4 if args.loaders else None,
        persistent_workers=False,
    )
    middle = args.layers // 2
    model.train()
    began = time.monotonic()
    samples = tokens = 0
    history = []
    running = {"answer": 0.0, "patch": 0.0}
    window = dict.fromkeys(KIND_WEIGHTS, (0, 0))  # first-token accuracy on the training rows, per log line
    for step, batch in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits, out = answer_logits(model, batch, hidden_states=True)
            answer = nn.functional.cross_entropy(logits, batch.answer_ids)
            # Per-patch targets weigh less as the answers take over.
            aux_weight = args.aux * (1 - 0.8 * step / args.steps)
            patch = heads.loss(out.hidden_states[middle], out.last_hidden_state, batch)
        hits = (logits.argmax(-1) == batch.answer_ids)[batch.first].tolist()
        for kind, hit in zip(batch.kinds, hits, strict=True):
            window[kind] = (window[kind][0] + hit, window[kind][1] + 1)
        loss = answer + aux_weight * patch
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        schedule.step()
        samples += batch.input_ids.shape[0]
        tokens += batch.tokens
        running["answer"] = 0.98 * running["answer"] + 0.02 * answer.item()
        running["patch"] = 0.98 * running["patch"] + 0.02 * patch.item()
        if (step + 1) % 50 == 0:
            elapsed = time.monotonic() - began
            print(
                f"step {step + 1} | {elapsed / 60:.1f} min | {samples / elapsed:.1f} samples/s | "
                f"{tokens / elapsed:.0f} positions/s | loss answer {running['answer']:.3f} "
                f"patch {running['patch']:.3f} ({'/'.join(f'{p:.2f}' for p in heads.parts)}) | train "
                f"{' '.join(f'{k} {h / max(1, n):.2f}' for k, (h, n) in window.items())} "
                f"| lr {schedule.get_last_lr()[0]:.2e}",
                flush=True,
            )
            window = dict.fromkeys(KIND_WEIGHTS, (0, 0))
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            accuracy = evaluate(model, batcher, args.held_out // 2, bf16=args.bf16)
            elapsed = time.monotonic() - began
            history.append(
                {"step": step + 1, "minutes": round(elapsed / 60, 2), "samples": samples, **accuracy}
            )
            print("held-out", json.dumps(history[-1]), flush=True)
    elapsed = time.monotonic() - began
    final = evaluate(model, batcher, args.held_out)
    history.append({"step": args.steps, "minutes": round(elapsed / 60, 2), "samples": samples, **final})
    print("held-out (fp32)", json.dumps(history[-1]), flush=True)
    return {
        "minutes": round(elapsed / 60, 2),
        "samples": samples,
        "samples_per_s": round(samples / elapsed, 1),
        "positions_per_s": round(tokens / elapsed),
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
