"""A Fuyu-8B-shaped model with random weights, made in memory on the device, behind mrc's own backend
(workers/backends/fuyu.py): only the weights step differs; prompts, preprocessing, `generate()`, the
engine's step model, the cache capacity and the grammars are the worker's own code.

- bf16: built directly on the device in bf16 (18.8 GB for Fuyu-8B; nothing written to or read from
  disk, which would cost two 18.8 GB passes over the GPU machine's disk).
- nf4: the same random weights quantized by from_pretrained's bitsandbytes path, fed from the bf16
  state dict in memory (`from_pretrained(None, config=..., state_dict=...)`), so bf16 and NF4 share
  their weights and differ only in how they are stored and multiplied.

The tokenizer and image processor are the tiny Fuyu's (workers/backends/tiny.py): Fuyu-8B's tokenizer
comes with its weights, which cannot be downloaded. Token ids stay below the tiny vocabulary, which
changes nothing in a step's cost (the embedding is a lookup, the output layer is full width).
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from shared.settings import Settings
from workers.backends.fuyu import FuyuBackend
from workers.backends.fuyu_loading import quantization_kwargs
from workers.backends.tiny import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]
HOME = str(ROOT / ".cache" / "mrc")


def config_of(shape: str) -> Any:
    """`fuyu-8b`: Fuyu-8B's configuration (FuyuConfig's defaults) with the tiny tokenizer's image and
    pad ids; `tiny`: the tiny Fuyu's own configuration (the CPU smoke run)."""
    from transformers import AutoProcessor, FuyuConfig

    tiny = ensure_tiny_model(HOME)
    if shape == "tiny":
        return FuyuConfig.from_pretrained(tiny)
    speaker = AutoProcessor.from_pretrained(tiny, local_files_only=True).tokenizer.convert_tokens_to_ids(
        "|SPEAKER|"
    )
    return FuyuConfig(image_token_id=speaker, pad_token_id=0)


def build(config: Any, device: str, dtype: torch.dtype, attention: str = "sdpa") -> Any:
    """Random weights, initialised on `device` in `dtype` (transformers' own initialisation)."""
    from transformers import FuyuForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = FuyuForCausalLM._from_config(config, dtype=dtype, attn_implementation=attention)
    return model.eval()


class RandomFuyu(FuyuBackend):
    """FuyuBackend whose weights come from `source` (a bf16 model in memory) instead of a folder."""

    def __init__(self, settings: Settings, source: Any) -> None:
        super().__init__(settings)
        self.source_model = source
        self.folder = Path(tempfile.mkdtemp(prefix="random-fuyu-"))
        # What load() reads besides the weights: the processor, and config.json (the revision's hash).
        from transformers import AutoProcessor

        AutoProcessor.from_pretrained(ensure_tiny_model(HOME), local_files_only=True).save_pretrained(
            self.folder
        )
        source.config.save_pretrained(self.folder)
        self.source = str(self.folder)
        text = source.config.text_config
        self.model_id = f"random-weights fuyu ({text.num_hidden_layers} layers x {text.hidden_size})"

    load_error: str | None = None

    def load(self) -> None:
        """FuyuBackend's load; a failure after the weights are in (the grammar library's, say) is
        recorded in `load_error`, not raised: the figures that need no structured answers still come."""
        try:
            super().load()
        except Exception as exc:
            if self.model is None or getattr(self, "control_text", None) is None:
                raise
            self.load_error = f"{type(exc).__name__}: {exc}"[:500]
            print(f"load after the weights failed: {self.load_error}", flush=True)

    def _weights(self, path: str) -> Any:
        if self.quantization == "bf16":
            return self.source_model
        from transformers import FuyuForCausalLM

        kwargs = quantization_kwargs(self.quantization, self.device)
        return FuyuForCausalLM.from_pretrained(
            None,
            config=self.source_model.config,
            state_dict=self.source_model.state_dict(),
            attn_implementation=self.settings.attention,
            **kwargs,
        )

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def backend(source: Any, quantization: str, device: str, **settings: Any) -> RandomFuyu:
    """A loaded backend over the random weights in `source` (bf16 as is, nf4 quantized from them)."""
    made = RandomFuyu(
        Settings(model="tiny", quantization=quantization, device=device, home=HOME, **settings), source
    )
    made.load()
    return made


def warm_up(backend: RandomFuyu) -> str:
    """The worker's warm-up (the prefill's attention kernel, or why it failed: the benchmarks measure
    without it, where the worker would refuse to start)."""
    try:
        return str(backend.warm_up())
    except Exception as exc:
        print(f"warm-up failed: {exc!r}", flush=True)
        return f"warm-up failed: {type(exc).__name__}: {exc}"[:300]


def free(device: str) -> None:
    gc.collect()  # a dropped runner's cache and captured graphs: freed before free memory is measured
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
