"""Model backends behind one protocol (base.ModelBackend), chosen from settings by `make_backend`.

- `fuyu`: Fuyu-8B, or any Fuyu checkpoint, from a local folder or the offline HF cache; `tiny` builds
  the toy Fuyu and loads it through the same code.
- `echo`: no model at all (answers from the prompt): for the broker benchmarks and the unit tests. As a
  worker's model it reads images' headers, never their pixels, and the worker loads no torch.

A new model is a module here with a class that has ModelBackend's methods, and one line below.
"""

from __future__ import annotations

from shared.settings import Settings
from workers.backends.base import ModelBackend


def make_backend(settings: Settings) -> ModelBackend:
    """The backend MRC_MODEL names: `echo`, else Fuyu (`tiny`, a local folder or a hub id)."""
    if settings.model == "echo":
        from workers.backends.echo import EchoBackend

        fault = RuntimeError("CUDA error: an illegal memory access (injected: MRC_ECHO_DEVICE_FAULT_ON)")
        return EchoBackend(
            fail_on=settings.echo_device_fault_on or None,
            error=fault,
            token_s=settings.echo_token_ms / 1000,
            needs_pixels=False,
        )
    from workers.backends.fuyu import FuyuBackend

    return FuyuBackend(settings)
