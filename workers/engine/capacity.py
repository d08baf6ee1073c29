"""How many slots the cache may have: measured from free memory at warm-up, capped by the settings.

A slot holds one row to its longest (the largest image, the longest prompt and the most new tokens:
the backend's `slot_positions`), so the cache is slots x positions x bytes per position, allocated
once. On CUDA the memory left for it is what is free after the model, warm-up and the activations of
the largest prefill allowed (measured by running one), less a margin; on the CPU, a share of the RAM
available (the host also runs the decode threads, the page cache and its neighbours).
"""

from __future__ import annotations

from typing import Any

CUDA_MARGIN = 0.10  # of the memory left after the largest prefill: the allocator's slack, fragmentation
CPU_SHARE = 0.5  # of MemAvailable


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


def memory_for_cache(device: str, prefill_peak: int = 0) -> tuple[int, str]:
    """Bytes the cache may take, and how that was measured. `prefill_peak`: what the largest prefill
    allowed took on top of the model (CUDA: measured by the backend at warm-up)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # what warm-up cached is free for the cache too
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        left = max(0, free - prefill_peak)
        return int(left * (1 - CUDA_MARGIN)), (
            f"{1 - CUDA_MARGIN:.0%} of {left / 2**30:.1f} GiB free on {device} after the largest prefill "
            f"({prefill_peak / 2**30:.2f} GiB)"
        )
    available = _available_ram()
    return int(available * CPU_SHARE), f"{CPU_SHARE:.0%} of {available / 2**30:.1f} GiB available RAM"


def slots(memory: int, per_token: int, positions: int) -> int:
    """Slots of `positions` positions (and the scratch one) that `memory` bytes hold."""
    return memory // (per_token * (positions + 1))


def choose(fit: int, wanted: int, token_budget: int, positions: int) -> int:
    """The cache's slots: what memory holds, at most MRC_MODEL_BATCH_MAX_JOBS and the positions of
    MRC_BATCH_TOKEN_BUDGET; at least one (a job that fits nowhere fails alone, out of memory)."""
    return max(1, min(fit, wanted, token_budget // max(1, positions)))
