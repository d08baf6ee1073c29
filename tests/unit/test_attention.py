from __future__ import annotations

from pathlib import Path

import pytest

from shared.settings import Settings
from workers.backends import attention
from workers.backends.fuyu import FuyuBackend

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")


@pytest.mark.parametrize(
    ("ops", "kernel"),
    [
        (["aten::linear", "aten::_scaled_dot_product_flash_attention_for_cpu"], "flash_cpu"),
        (["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention"], "flash"),
        (["aten::_scaled_dot_product_efficient_attention"], "mem_efficient"),
        (["aten::_scaled_dot_product_cudnn_attention"], "cudnn"),
        (["aten::_scaled_dot_product_attention_math", "aten::_softmax"], "math"),
        (["aten::matmul", "aten::softmax"], "math"),
        (["aten::linear"], "unknown"),
    ],
)
def test_kernel_names_from_trace_ops(ops: list[str], kernel: str) -> None:
    assert attention.kernel_from_ops(ops) == kernel


@pytest.mark.parametrize(("implementation", "kernel"), [("sdpa", "flash_cpu"), ("eager", "math")])
def test_warm_up_attests_the_kernel_that_ran(implementation: str, kernel: str) -> None:
    backend = FuyuBackend(
        Settings(model="tiny", home=HOME, quantization="fp32", device="cpu", attention=implementation)
    )
    backend.load()
    assert backend.warm_up() == kernel
    assert backend.describe()["attention_backend"] == f"{implementation}:{kernel}"
    # The engine's masked decode step (two merged rows of unequal length) is attested too: the name
    # alone cannot show the lost causal path (docs/design.md), so each result also says its path.
    assert backend.describe()["attention_backend_decode"] == f"{implementation}:{kernel}"
    assert backend.describe()["attention_backend_padded"] == backend.describe()["attention_backend_decode"]
    assert (kernel in attention.FAST_KERNELS) is (implementation == "sdpa")
