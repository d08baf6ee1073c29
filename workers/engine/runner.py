"""The engine's only model calls (torch): prefill one job alone, decode one step for the batch."""

from __future__ import annotations

from typing import Any

import torch

from workers.engine.kv import Batch


class Runner:
    def __init__(self, model: Any) -> None:
        self.model = model

    @torch.inference_mode()
    def prefill(self, inputs: Any) -> tuple[int, Any, int]:
        """(first generated token, the row's cache, positions it holds) for one job's inputs, alone:
        no padding, so prefill takes the causal path and needs no mask."""
        out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        return token, out.cache, int(inputs["input_ids"].shape[1])

    @torch.inference_mode()
    def decode(self, batch: Batch, last_tokens: list[int]) -> list[int]:
        """One step for every running row: feed each row's last token, return each row's next."""
        assert batch.mask is not None
        positions = batch.grow()
        ids = torch.tensor(last_tokens, dtype=torch.long, device=batch.mask.device).unsqueeze(1)
        out = self.model(
            input_ids=ids,
            attention_mask=batch.mask,
            position_ids=positions,
            cache=batch.cache,
            use_cache=True,
        )
        batch.cache = out.cache
        return [int(t) for t in out.logits[:, -1].argmax(dim=-1).tolist()]
