"""How large the cache's pool may be: measured from free memory at warm-up, capped by the settings.

The cache is one pool of positions (workers/engine/slot_table.py), allocated once: positions x bytes
per position. Held by need (the `rows` decode), it is what memory holds, at most
MRC_BATCH_TOKEN_BUDGET positions, and the rows in it at most MRC_MODEL_BATCH_MAX_JOBS; in the uniform
grid (the `fixed` decode) it is slots of the longest row (the largest image, the longest prompt and
the most new tokens: the backend's `slot_positions`). On CUDA the memory left for it is what is free
after the model, warm-up and the activations of the largest prefill allowed (measured by running
one), less a margin; on the CPU, a share of the RAM available (the host also runs the decode
threads, the page cache and its neighbours).
"""

from __future__ import annotations

from typing import Any

# Prefill positions a step computes (MRC_ENGINE_PREFILL_TOKENS=auto). The CPU: 512, measured (a chunk
# costs what its positions cost there: 1.08-1.14x the whole prefill of 1,300-2,400 positions on equal
# threads). CUDA: a call costs ~20 ms whatever its size on the H200's first run (a 16-position prefix
# hit 20-22 ms; a call's launches through 36 layers) and the whole 2,400-position prefill 86 ms
# (0.036 ms a position), so chunks of 512 cost 1.29x the whole (111 ms, five calls at the floor) while
# 1,024 are derived to cost ~1.07x with a ticket's wait behind one chunk ~37 ms (docs/benchmarks.md,
# "GPU, H200"; the proving ground's prefill step measures 512, 1,024 and 2,048).
PREFILL_TOKENS = {"cpu": 512, "cuda": 1024}
CUDA_MARGIN = 0.10  # of the memory left after the largest prefill: the allocator's slack, fragmentation
CPU_SHARE = 0.5  # of MemAvailable


def prefill_tokens(setting: int | str, device: str) -> int:
    """The step's prefill positions: the setting, or by the device (auto)."""
    if setting != "auto":
        return int(setting)
    return PREFILL_TOKENS["cuda" if str(device).startswith("cuda") else "cpu"]


def bytes_per_token(config: Any, dtype: Any) -> int:
    """Keys and values of every layer for one position (Persimmon: no grouped-query attention)."""
    text = getattr(config, "text_config", config)
    layers = int(text.num_hidden_layers)
    heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    element = int(getattr(dtype, "itemsize", 2))
    return 2 * layers * heads * head_dim * element


def beside_the_pool(config: Any, dtype: Any, positions: int, decode: str) -> int:
    """Bytes a cache allocates beside its pool's positions (workers/engine/kv.py): by need, a staging
    buffer of one longest row (one layer's keys or values: what an overlapping compaction move goes
    through) and, with the pool step, a scratch position past the pool. ~28 MB for Fuyu-8B, once
    inside the 10 % margin unsaid: the sizing counts them now."""
    if decode == "fixed":
        return 0  # the uniform grid's scratch columns are inside its slots
    per_position = bytes_per_token(config, dtype)
    text = getattr(config, "text_config", config)
    staging = positions * per_position // (2 * int(text.num_hidden_layers))
    return staging + (per_position if decode == "pool" else 0)


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


def positions_held(memory: int, per_token: int) -> int:
    """Cache positions that `memory` bytes hold."""
    return memory // max(1, per_token)


def slot_grain(decode: str, device: Any) -> int:
    """What slots by need are rounded up to, and start at multiples of: the pool step's attention
    kernel's block (its batch invariance: workers/engine/pool_step.py), else the prefix index's block."""
    if decode != "pool":  # the pool step is torch's: the echo worker loads no torch
        from workers.engine.slot_table import UNIT

        return UNIT
    from workers.engine import pool_step

    return pool_step.grain(device)


def choose(
    fit: int, wanted: int, token_budget: int, positions: int, uniform: bool = False, grain: int = 16
) -> tuple[int, int]:
    """(rows at most, positions in the pool) for `fit` positions that memory holds. By need: the pool
    is what memory holds, at most MRC_BATCH_TOKEN_BUDGET, at least one longest row (a job that fits
    nowhere fails alone, out of memory); rows at most MRC_MODEL_BATCH_MAX_JOBS. Uniform: slots of the
    longest row (and a scratch column), as many as both hold and MRC_MODEL_BATCH_MAX_JOBS allows."""
    from workers.engine.slot_table import rounded

    if uniform:
        slots = max(1, min(fit // (positions + 1), wanted, token_budget // max(1, positions)))
        return slots, slots * (positions + 1)
    pool = min(fit, token_budget)
    return wanted, max(rounded(positions, grain), pool - pool % grain)  # no slot starts past the last grain


def reserve(tickets: int, pool: int, positions: int, uniform: bool = False, grain: int = 16) -> int:
    """Positions of the pool backlog rows never take: room for `tickets` tickets at their longest, at
    most what leaves one longest backlog row its room."""
    from workers.engine.slot_table import rounded

    longest = positions + 1 if uniform else rounded(positions, grain)
    return max(0, min(tickets * longest, pool - longest))
