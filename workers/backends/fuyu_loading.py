"""Where a Fuyu's weights come from and how they load: the device asked for, `from_pretrained`'s
arguments for each quantization (NF4 through bitsandbytes), and the revision that keys the result
cache (a hub commit, or a fingerprint of a local folder)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from shared.errors import ModelError


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"MRC_DEVICE={requested} but CUDA is not available")
    return requested


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".index.json")


def revision_of(config: Any, path: str) -> str:
    """The hub commit the weights came from; for a local folder, a hash of its config.json and of the
    weight files' names, sizes and modification times, so swapped weights never keep serving answers
    cached for the old ones (hashing gigabytes of weights at every start would cost minutes)."""
    commit = getattr(config, "_commit_hash", None)
    if commit:
        return str(commit)
    folder = Path(path)
    config_file = folder / "config.json"
    digest = hashlib.sha256(
        config_file.read_bytes() if config_file.is_file() else repr(config.to_dict()).encode()
    )
    if folder.is_dir():
        for weights in sorted(p for p in folder.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES)):
            stat = weights.stat()
            digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return "local-" + digest.hexdigest()[:16]


def quantization_kwargs(quantization: str, device: str) -> dict[str, Any]:
    """from_pretrained keyword arguments for one quantization mode."""
    import torch
    from transformers import BitsAndBytesConfig

    if quantization == "nf4":
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
            # The vision projection (30*30*3 = 2700 wide) breaks bnb's packed CPU path, and the list
            # replaces the default one, so lm_head must be named too (STACK-NOTES.md).
            llm_int8_skip_modules=["vision_embed_tokens", "lm_head"],
        )
        return {"quantization_config": config, "dtype": torch.bfloat16, "device_map": {"": device}}
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    return {"dtype": dtypes[quantization], "device_map": {"": device}}
