"""The running batch's KV cache and attention mask: rows of different lengths, left-padded.

A prefilled row's cache is merged in by left-padding every row to the longest along the sequence axis
(zeros in the attention mask over the padding); a finished row leaves by index-selecting it out of
every layer and of the mask; columns that no remaining row uses are trimmed from the left. Position
ids come from the mask (a row's positions count its own tokens only), so padding never shifts a row.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _build(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    cache = DynamicCache()
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """[rows, heads, T, dim] -> [rows, heads, length, dim], zeros on the left."""
    missing = length - tensor.shape[2]
    if missing <= 0:
        return tensor
    pad = tensor.new_zeros((tensor.shape[0], tensor.shape[1], missing, tensor.shape[3]))
    return torch.cat([pad, tensor], dim=2)


class Batch:
    """The rows running together: their ids (in cache order), one cache, one mask."""

    def __init__(self) -> None:
        self.row_ids: list[str] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [rows, T] long: 1 where a row has a real position

    def __len__(self) -> int:
        return len(self.row_ids)

    def add(self, row_ids: list[str], cache: Any, length: int) -> None:
        """Merge rows prefilled together, unpadded (their cache holds exactly `length` positions each)."""
        device = cache.layers[0].keys.device
        self._join(list(row_ids), cache, torch.ones((len(row_ids), length), dtype=torch.long, device=device))

    def absorb(self, other: Batch) -> None:
        """Merge another batch's rows (a held group coming back) after this one's."""
        if other.mask is not None:
            self._join(other.row_ids, other.cache, other.mask)

    def take(self, row_ids: set[str]) -> Batch:
        """Move these rows, with their cache, out into a batch of their own."""
        taken = Batch()
        order = [row for row in self.row_ids if row in row_ids]
        if order and self.mask is not None:
            taken.row_ids = order
            taken.cache, taken.mask = self._select([self.row_ids.index(row) for row in order])
            self.drop(set(order))
        return taken

    def _join(self, row_ids: list[str], cache: Any, mask: torch.Tensor) -> None:
        if self.cache is None or self.mask is None:
            self.row_ids, self.cache, self.mask = row_ids, cache, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        merged = []
        for (keys, values), (new_keys, new_values) in zip(_layers(self.cache), _layers(cache), strict=True):
            merged.append(
                (
                    torch.cat([_left_pad(keys, width), _left_pad(new_keys, width)], dim=0),
                    torch.cat([_left_pad(values, width), _left_pad(new_values, width)], dim=0),
                )
            )
        old = torch.nn.functional.pad(self.mask, (width - self.mask.shape[1], 0))
        new = torch.nn.functional.pad(mask, (width - mask.shape[1], 0))
        self.cache, self.mask = _build(merged), torch.cat([old, new], dim=0)
        self.row_ids = [*self.row_ids, *row_ids]

    def _select(self, keep: list[int]) -> tuple[Any, torch.Tensor]:
        """The cache and mask of these rows only, trimmed of the padding none of them needs."""
        assert self.mask is not None
        index = torch.tensor(keep, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        start = mask.shape[1] - int(mask.sum(dim=1).max())  # left-padded: real positions are last
        layers = [
            (keys.index_select(0, index)[:, :, start:], values.index_select(0, index)[:, :, start:])
            for keys, values in _layers(self.cache)
        ]
        return _build(layers), mask[:, start:].contiguous()

    def drop(self, row_ids: set[str]) -> None:
        """Remove finished rows; trim the padding columns no remaining row needs."""
        if not row_ids or self.mask is None:
            return
        keep = [i for i, row in enumerate(self.row_ids) if row not in row_ids]
        if not keep:
            self.row_ids, self.cache, self.mask = [], None, None
            return
        self.cache, self.mask = self._select(keep)
        self.row_ids = [self.row_ids[i] for i in keep]

    @property
    def held(self) -> int:
        """Positions the rows really hold (padding not counted)."""
        return 0 if self.mask is None else int(self.mask.sum())

    @property
    def width(self) -> int:
        """Positions per row in the cache, padding included: what the batch really holds."""
        return 0 if self.mask is None else int(self.mask.shape[1])

    def next_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask for the next step (one more real position per row) and the rows' positions;
        `commit` it once the step succeeded, so a failed step leaves the batch as it was."""
        assert self.mask is not None
        mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        return mask, (mask.sum(dim=1, keepdim=True) - 1).long()

    def commit(self, mask: torch.Tensor, cache: Any) -> None:
        self.mask, self.cache = mask, cache
