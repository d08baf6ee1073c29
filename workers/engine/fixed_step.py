"""The decode step of fixed shapes (the GPU's): one call over a prefix of the slots, capturable.

Shapes come from a few buckets — slots covered rounded up to a power of two, the width read rounded
up to one of WIDTHS — so a handful of steps serve every batch, and each can be compiled
(`torch.compile(fullgraph=True)`: tests/unit/test_fixed_step.py) or captured once as a CUDA graph and
replayed. Inputs are written into the step's own static tensors; the step reads the slot cache through
a prefix view (`[:slots, :, :width]`, no copy), with a 4-D float mask that hides each row's positions
past its own length; slots of the prefix that no running row holds (held rows, holes) are masked to
one position and write their key and value to the cache's scratch column. Its only host sync is the
caller reading the tokens it picks.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.engine.kv import SlotCache

WIDTHS = (128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def rows_bucket(top: int, slots: int) -> int:
    """Slots a step covers: the prefix in use, rounded up to a power of two (at most every slot)."""
    covered = 1
    while covered < top:
        covered *= 2
    return min(covered, slots)


def width_bucket(width: int, positions: int) -> int:
    """Positions a step reads per slot: the longest row's, rounded up to a bucket (at most a slot's)."""
    return min(next((w for w in WIDTHS if w >= width), positions), positions)


def buckets(slots: int, positions: int) -> list[tuple[int, int]]:
    """Every (slots, width) shape a step may take: what capture at warm-up covers."""
    rows = sorted({rows_bucket(2**k, slots) for k in range(slots.bit_length() + 1)})
    widths = sorted({width_bucket(w, positions) for w in (*WIDTHS, positions)})
    return [(r, w) for r in rows for w in widths]


class StaticStep:
    """A decode step whose inputs live in its own static tensors: run eagerly (`forward`) or captured
    once as a CUDA graph and replayed. Subclasses fill the inputs and define `last_hidden`.

    The graph records the language model up to each row's last hidden state; the vocabulary
    projection runs after the replay, one more kernel. Each graph's output stays allocated as long
    as the graph: logits ([rows, 262,144] floats for Fuyu-8B) kept by each of a hundred graphs would
    hold gigabytes; hidden states ([rows, 4,096]) hold a sixty-fourth of that."""

    model: Any
    graph: Any = None
    hidden: torch.Tensor | None = None  # the captured step's output: each row's last hidden state

    def last_hidden(self) -> torch.Tensor:
        """Each row's last hidden state [rows, hidden] for the filled inputs."""
        raise NotImplementedError

    def forward(self) -> torch.Tensor:
        """Logits [rows, vocabulary] for the filled inputs."""
        logits: torch.Tensor = self.model.lm_head(self.last_hidden())
        return logits

    def _hidden(
        self, language: Any, ids: torch.Tensor, mask: torch.Tensor, positions: Any, cache: Any
    ) -> Any:
        """The language model over the step's static inputs, writing to and reading from `cache`."""
        return language(
            inputs_embeds=language.get_input_embeddings()(ids),
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
        ).last_hidden_state

    def run(self) -> torch.Tensor:
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        assert self.hidden is not None
        logits: torch.Tensor = self.model.lm_head(self.hidden)
        return logits

    def capture(self, pool: Any) -> None:
        """Record the step as a CUDA graph (after two eager runs on a side stream, as CUDA graphs need)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.hidden = self.last_hidden()
        self.graph = graph


class FixedStep(StaticStep):
    """One decode step of `slots` x `width`: static inputs, an eager or captured forward pass."""

    def __init__(self, model: Any, cache: SlotCache, slots: int, width: int) -> None:
        self.model, self.cache, self.slots, self.width = model, cache, slots, width
        self.language = model.model.language_model
        device, dtype = cache.keys[0].device, cache.keys[0].dtype
        self.ids = torch.zeros((slots, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((slots, 1), dtype=torch.long, device=device)
        self.write = torch.full((slots,), cache.scratch, dtype=torch.long, device=device)
        self.rows = torch.arange(slots, device=device)
        self.lowest = torch.finfo(dtype).min
        self.mask = torch.full((slots, 1, 1, width), self.lowest, dtype=dtype, device=device)
        self._columns = torch.arange(width, device=device)

    def fill(self, slots: list[int], lengths: list[int], tokens: list[int]) -> None:
        """The step's inputs: each running row's last token at its slot, its position = its length."""
        device = self.ids.device
        index = torch.tensor(slots, device=device)
        length = torch.tensor(lengths, device=device)
        self.ids.zero_()
        self.positions.zero_()
        self.write.fill_(self.cache.scratch)
        self.mask.fill_(self.lowest)
        self.mask[:, :, :, 0] = 0  # a slot no row runs in attends to one position: no NaN in its row
        self.ids[index, 0] = torch.tensor(tokens, device=device)
        self.positions[index, 0] = length
        self.write[index] = length
        visible = self._columns.unsqueeze(0) <= length.unsqueeze(1)  # its positions, and the new one
        rows = torch.where(visible, 0.0, self.lowest).to(self.mask.dtype)
        self.mask[index] = rows.view(len(slots), 1, 1, -1)

    def last_hidden(self) -> torch.Tensor:
        """[slots, hidden], a row per slot of the step."""
        cache = self.cache
        cache.rows, cache.write, cache.view = self.rows, self.write, (self.slots, self.width)
        cache.extent = None
        hidden: torch.Tensor = self._hidden(self.language, self.ids, self.mask, self.positions, cache)
        return hidden[:, -1]
