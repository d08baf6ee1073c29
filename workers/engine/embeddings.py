"""A prefilling row's input embeddings: its token embeddings with its image's patches projected in
place, what Fuyu's own forward does before its language model. Made once per row, as its first chunk
runs (workers/engine/runner.py `Runner.embedded`), and sliced by each chunk; the patches of a prefix it
copied by then are not projected."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PROJECTED_AT_LEAST = 64  # image patches projected for a row with a prefix hit (`embed`)


@dataclass(slots=True)
class Prefill:
    """A row whose prefill is under way: its inputs until its embeddings are made, its prefix's block
    hashes and its prompt's length."""

    inputs: Any
    hashes: list[bytes]
    length: int
    embeddings: torch.Tensor | None = None


def embed(model: Any, inputs: Any, reused: int = 0) -> torch.Tensor:
    """The row's input embeddings, image patches in place: what Fuyu's own forward does before its
    language model, made once per row and sliced by each chunk. The patches of the first `reused`
    positions (a prefix hit: never computed again) are not projected: a photo's questions after
    its first project only the patches past the hit, where each projected all (their positions
    keep the placeholder's embedding, which no chunk reads)."""
    fuyu = model.model
    ids = inputs["input_ids"]
    embeddings: torch.Tensor = fuyu.language_model.get_input_embeddings()(ids)
    pixels = inputs.get("pixel_values")
    if pixels is None:
        return embeddings
    placeholders = ids == fuyu.config.image_token_id
    # What is projected keeps at least PROJECTED_AT_LEAST patches: a matrix product of a few rows
    # takes other kernels than one of many (other last bits: measured under 12 rows on this CPU),
    # and the positions past a hit are to be those of the same photo without it, bit for bit.
    skipped = max(0, min(int(placeholders[0, :reused].sum()), pixels.shape[-2] - PROJECTED_AT_LEAST))
    if skipped:
        pixels = pixels[..., skipped:, :]
        placeholders = placeholders & (placeholders.cumsum(-1) > skipped)
    patches = fuyu.get_image_features(pixels, return_dict=True).last_hidden_state
    patches = patches.to(embeddings.device, embeddings.dtype)
    if int(placeholders.sum()) != patches.shape[:-1].numel():
        raise ValueError(
            f"{int(placeholders.sum())} image placeholders for {patches.shape[:-1].numel()} patches"
        )
    return embeddings.masked_scatter(placeholders.unsqueeze(-1).expand_as(embeddings), patches)
