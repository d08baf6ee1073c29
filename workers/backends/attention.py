"""Which scaled-dot-product-attention kernel really runs, read from a profiler trace of one batch."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator

# Op names in a trace -> kernel. Order matters: the first match wins.
_KERNELS: tuple[tuple[str, str], ...] = (
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "flash_cpu"),
    ("aten::_scaled_dot_product_fused_attention_overrideable", "fused"),
    ("aten::_scaled_dot_product_cudnn_attention", "cudnn"),
    ("aten::_scaled_dot_product_flash_attention", "flash"),
    ("aten::_scaled_dot_product_efficient_attention", "mem_efficient"),
    ("aten::_scaled_dot_product_attention_math", "math"),
)
FAST_KERNELS = frozenset({"flash_cpu", "fused", "cudnn", "flash", "mem_efficient"})


def kernel_from_ops(op_names: Iterable[str]) -> str:
    """The attention kernel named by a trace's op names; 'math' for eager softmax attention."""
    names = set(op_names)
    for op, kernel in _KERNELS:
        if op in names:
            return kernel
    if "aten::softmax" in names or "aten::_softmax" in names:
        return "math"
    return "unknown"


def attest(run_batch: Callable[[], object], device: str) -> str:
    """Run one batch under the profiler and name the attention kernel that ran in it."""
    import torch  # here, not with the module: the worker reads FAST_KERNELS whatever its model
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with _quiet_native_stderr(), profile(activities=activities) as prof:
        run_batch()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return kernel_from_ops(event.name for event in prof.events())


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Kineto writes unformatted lines (profiler_start, gpuGetDeviceCount...) straight to fd 2, which
    would break the one-event-per-line log format; silence fd 2 for the duration of the trace."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
