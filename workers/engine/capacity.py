"""How many cache positions the engine may admit: measured from free memory at warm-up, capped by
MRC_BATCH_TOKEN_BUDGET."""

from __future__ import annotations

from typing import Any

CUDA_SHARE = 0.85  # of the memory free after loading and warm-up; the rest: activations, allocator slack
CPU_SHARE = 0.5  # of MemAvailable: the host runs the decode threads, the API's neighbours, the page cache


def bytes_per_token(config: Any, dtype: Any) -> int:
    """Keys and values of every layer for one position (Persimmon: no grouped-query attention)."""
    text = getattr(config, "text_config", config)
    layers = int(text.num_hidden_layers)
    heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    element = int(getattr(dtype, "itemsize", 2))
    return 2 * layers * heads * head_dim * element


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def measure(config: Any, dtype: Any, device: str) -> tuple[int, str]:
    import torch

    per_token = bytes_per_token(config, dtype)
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        budget, where = int(free * CUDA_SHARE), f"{CUDA_SHARE:.0%} of {free / 2**30:.1f} GiB free on {device}"
    else:
        available = _available_ram()
        budget, where = (
            int(available * CPU_SHARE),
            f"{CPU_SHARE:.0%} of {available / 2**30:.1f} GiB available RAM",
        )
    return max(1, budget // per_token), f"{where}, {per_token} bytes per position"


def limit(measured: int, cap: int) -> int:
    """The engine's capacity: what memory holds, never above the configured cap."""
    return max(1, min(measured, cap))
