"""The engine's only model calls (torch): prefill jobs of one length together, decode one step for
every running row. It owns the slot cache (workers/engine/kv.py) and the two ways a decode step runs:

- `rows` (the CPU's default): the running rows as they are, each attending to its own length in its
  own slot (workers/engine/row_attention.py): nothing padded, nothing gathered;
- `fixed` (CUDA's default): one call of fixed shape over a prefix of the slots, bucketed, each bucket's
  step captured once as a CUDA graph at warm-up and replayed (workers/engine/fixed_step.py);
- `pool`: one call of fixed shape over the pool's used prefix, slots by need, each row masked to its
  own, bucketed and captured the same way (workers/engine/pool_step.py).

`StepModel` (workers/engine/step.py) is the seam: this runner serves transformers' Fuyu; the echo
backend has its own (workers/backends/echo.py), so the worker's tests drive the same engine without
weights.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Literal

import torch

from workers.engine import capacity, pool_step, row_attention
from workers.engine import masks as grammar_masks
from workers.engine.embeddings import Prefill, embed
from workers.engine.fixed_step import FixedStep, StaticStep, buckets, rows_bucket, width_bucket
from workers.engine.kv import SlotBatch, SlotCache
from workers.engine.masks import MaskFn
from workers.engine.prefix_index import chain
from workers.engine.sequence import DEAD_END
from workers.engine.slot_table import NoFreeSlot, SlotTable, pool_for

DecodeMode = Literal["rows", "fixed", "pool"]


# Sets the CPU threads for a model call of that many positions (workers/cpu_threads.py); None: as is.
Threads = Callable[[int, str], object] | None


class Runner:
    def __init__(
        self,
        model: Any,
        slots: int,
        positions: int,
        threads: Threads = None,
        decode: DecodeMode = "rows",
        reuse: bool = True,
        pool: int | None = None,
    ) -> None:
        """`slots` rows at most of up to `positions` positions each. The `rows` and `pool` decodes hold
        each row's need in a pool of `pool` positions (the memory of `slots` worst-case slots when not
        said); the `fixed` one a grid of `slots` worst-case slots (its fixed shapes read it as a view)."""
        self.model, self.threads, self.decode_mode, self.reuse = model, threads, decode, reuse
        self.language = model.model.language_model
        text = self.language.config
        heads = int(text.num_attention_heads)
        embeddings = self.language.get_input_embeddings().weight
        if decode == "fixed":
            self.table = SlotTable(slots, positions)
        else:
            grain = capacity.slot_grain(decode, embeddings.device)
            pool = pool or pool_for(slots, positions, grain)
            if decode == "pool":  # the pool step reads whole kernel blocks (workers/engine/pool_step.py)
                pool -= pool % grain
            self.table = SlotTable(slots, positions, capacity=pool, grain=grain)
        self.cache = SlotCache(
            int(text.num_hidden_layers), self.table.pool, heads, int(text.hidden_size) // heads,
            embeddings.dtype, embeddings.device, stride=positions + 1 if self.table.uniform else 1,
            scratch=decode == "pool", staging=0 if self.table.uniform else positions,
            finite=decode != "rows",
        )  # fmt: skip
        self.table.mover = self.cache.move
        self._steps: dict[tuple[int, int], StaticStep] = {}
        self.captured = 0  # fixed-shape steps recorded as CUDA graphs
        # Rows whose prefill is under way: their inputs and prefix block hashes, and their embeddings
        # once their first chunk runs (workers/engine/embeddings.py).
        self._pending: dict[str, Prefill] = {}
        # Positions each of those rows' prefill computes in all (its prompt less what it reused): what
        # sizes a call's CPU threads, so a chunk of a long prompt gets the threads its prompt whole
        # would, and a question's few positions after its photo's prefix hit stay on one thread.
        self._work: dict[str, int] = {}

    def new_batch(self) -> SlotBatch:
        return SlotBatch(self.table, self.cache)

    @torch.inference_mode()
    def prefill(self, inputs: list[Any], masks: MaskFn | None = None) -> tuple[list[int], Any, int]:
        """(each row's first generated token, the rows' cache, positions each holds) for jobs of one
        input length, prefilled together: no padding, so prefill takes the causal path, no mask.
        `masks`: the rows' grammar mask (structured answers), asked for once the call is launched."""
        joined = inputs[0] if len(inputs) == 1 else {k: torch.cat([i[k] for i in inputs]) for k in inputs[0]}
        length = int(joined["input_ids"].shape[1])
        if self.threads is not None:
            self.threads(int(joined["input_ids"].numel()), "prefill")
        out = _freeing_on_oom(lambda: self.model(**joined, use_cache=True, logits_to_keep=1))
        return _pick(out.logits[:, -1], masks), out.cache, length

    @torch.inference_mode()
    def begin(
        self, row_id: str, inputs: Any, length: int, identity: Hashable | None = None, need: int | None = None
    ) -> int:
        """A row about to prefill takes a slot with room for `need` positions (its prompt and its own
        new tokens; the longest job's when not said). Its leading positions that a slot already holds
        (the same image and prompt start, workers/engine/prefix_index.py) are taken over from a
        retained slot or copied from another row's, and never computed: returns how many (at least one
        position is always left to compute, for the row's first token)."""
        ids = inputs["input_ids"][0].tolist()
        if len(ids) != length:
            raise ValueError(f"row {row_id}: {len(ids)} input positions, {length} expected")
        need = max(length, need or self.table.positions)
        hashes = chain(identity, ids) if identity is not None and self.reuse else []
        table = self.table
        hit = table.index.match(hashes) if hashes else None
        reused = min(hit.positions, length - 1) if hit is not None else 0
        if hit is None or reused <= 0:
            reused = 0
            table.assign(row_id, 0, need)
        elif not table.retained(hit.holder) or table.take_over(row_id, hit.holder, reused, need) is None:
            self._copy_hit(row_id, hit.holder, reused, need)
        table.index.add(row_id, hashes[: reused // table.index.block])
        self._pending[row_id] = Prefill(inputs, hashes, length)
        self._work[row_id] = length - reused
        return reused

    def _copy_hit(self, row_id: str, holder: str, reused: int, need: int) -> None:
        """A slot of the row's own, the holder's first `reused` positions copied into it. The holder is
        never freed to make the room (compaction may move it: its start is read after), except a
        retained one when nothing else makes room: its positions are carried over through a copy."""
        table = self.table
        try:
            start = table.assign(row_id, reused, need, keep=holder)
        except NoFreeSlot:
            if not table.retained(holder):
                raise
            carried = self.cache.read(table.start(holder), reused)
            table.release(holder)
            self.cache.put(table.assign(row_id, reused, need), carried)
            return
        self.cache.move(table.start(holder), start, reused)
        if table.retained(holder):
            table.release(holder)  # the row holds the same positions now: one copy in memory is enough

    @torch.inference_mode()
    def catch_up(self, row_id: str) -> int:
        """Positions of the row's prefix that another row wrote since it began (questions about one
        photo admitted together: the first to prefill writes it for all), copied into its slot: how
        many it gained. A hit never depends on the order rows arrive in."""
        table = self.table
        hashes = self._pending[row_id].hashes
        hit = table.index.match(hashes) if hashes else None
        if hit is None or hit.holder == row_id:
            return 0
        have, total = table.length(row_id), self._pending[row_id].length
        reused = min(hit.positions, total - 1)
        if reused <= have:
            return 0
        self.cache.move(table.start(hit.holder), table.start(row_id), reused, start=have)
        table.set_length(row_id, reused)
        self._work[row_id] -= reused - have
        table.index.add(row_id, hashes[: reused // table.index.block])
        return reused - have

    @torch.inference_mode()
    def extend(self, chunks: list[tuple[str, int]], masks: MaskFn | None = None) -> list[int | None]:
        """Prefill each row's positions from what its slot holds up to its `stop`, in place, attending to
        every position before: one chunk a row, every row's in one call (the model's layers run once
        for all their positions; attention is each row's own, row_attention.per_chunk). Each row's
        first generated token when its stop ends its prompt, else None; `masks`: the grammar mask of
        those rows, in call order."""
        table, cache = self.table, self.cache
        plans = []  # (row, slot's start, chunk's start, stop, prompt length)
        for row_id, stop in chunks:
            length, start = self._pending[row_id].length, table.length(row_id)
            if not start < stop <= length:
                raise ValueError(f"row {row_id}: a chunk {start}..{stop} of {length} positions")
            plans.append((row_id, table.start(row_id), start, stop, length))
        if self.threads is not None:  # by the rows' whole prefills, not this call's part of them
            self.threads(sum(self._work[row_id] for row_id, *_ in plans), "prefill")
        embeddings = [self.embedded(row_id)[:, start:stop] for row_id, _, start, stop, _ in plans]
        device, dtype = embeddings[0].device, embeddings[0].dtype
        laid, offset = [], 0  # each chunk's place in the call
        for _, base, start, stop, _ in plans:
            laid.append((offset, stop - start, base, start, stop))
            offset += stop - start
        positions = torch.cat([torch.arange(start, stop, device=device) for _, _, start, stop, _ in plans])
        if len(plans) == 1:
            _, base, start, stop, _ = plans[0]
            cache.chunk = slice(base + start, base + stop)
        else:
            cache.chunk = torch.cat([positions[o : o + n] + base for o, n, base, *_ in laid])
        try:
            with row_attention.per_chunk(self.language.config, laid, dtype, device):
                hidden = _freeing_on_oom(
                    lambda: (
                        self.language(
                            inputs_embeds=embeddings[0] if len(plans) == 1 else torch.cat(embeddings, dim=1),
                            position_ids=positions.unsqueeze(0),
                            cache=cache,
                            use_cache=True,
                        ).last_hidden_state
                    )
                )
        finally:
            cache.chunk = None
        ends = [index for index, plan in enumerate(plans) if plan[3] == plan[4]]
        tokens: list[int | None] = [None] * len(plans)
        if ends:  # picked before anything is recorded: a pick that fails leaves every row as it was
            last = [laid[index][0] + laid[index][1] - 1 for index in ends]
            for index, token in zip(ends, _pick(self.model.lm_head(hidden[0, last]), masks), strict=True):
                tokens[index] = token
        for row_id, _, _, stop, length in plans:
            table.set_length(row_id, stop)
            table.index.add(row_id, self._pending[row_id].hashes[: stop // table.index.block])
            if stop == length:
                del self._pending[row_id], self._work[row_id]
        return tokens

    def sharing(self, row_id: str, writers: list[tuple[str, int]]) -> bool:
        """Whether these chunks (row, stop), about to run, write the block of prefix the row computes
        next (questions about one photo, admitted together): then it waits for them and copies it
        (catch_up), rather than compute it again beside them."""
        hashes, block = self._pending[row_id].hashes, self.table.index.block
        following = self.table.length(row_id) // block
        if following >= len(hashes):
            return False
        for writer, stop in writers:
            theirs = self._pending[writer].hashes
            writes = self.table.length(writer) < (following + 1) * block < stop + block  # not yet written
            if writes and theirs[following : following + 1] == [hashes[following]]:
                return True
        return False

    def abandon(self, row_id: str, keep: bool = False) -> None:
        """A row that leaves before its prefill is whole (paused, failed): its slot freed, or left to
        the prefix cache with the blocks it wrote (`keep`)."""
        self._pending.pop(row_id, None)
        self._work.pop(row_id, None)
        if row_id in self.table:
            if keep:
                self.table.retain(row_id)
            else:
                self.table.release(row_id)

    def embedded(self, row_id: str) -> torch.Tensor:
        """The row's input embeddings, made as its first chunk runs: what it copied of its photo's
        prefix by then (a hit at admission, or catch_up from a question admitted with it) is not
        projected, so questions about one photo admitted together project its patches once."""
        pending = self._pending[row_id]
        if pending.embeddings is None:
            pending.embeddings = embed(self.model, pending.inputs, self.table.length(row_id))
            pending.inputs = None  # the pixels are not needed again
        return pending.embeddings

    @torch.inference_mode()
    def decode(self, batch: SlotBatch, last_tokens: list[int], masks: MaskFn | None = None) -> list[int]:
        """One step for every running row: feed each row's last token, return each row's next."""
        if self.decode_mode != "rows":
            self._compact()
        starts = [self.table.start(row_id) for row_id in batch.row_ids]
        lengths = [self.table.length(row_id) for row_id in batch.row_ids]
        run = {"fixed": self._decode_fixed, "pool": self._decode_pool}.get(
            self.decode_mode, self._decode_rows
        )
        logits = _freeing_on_oom(lambda: run(batch, starts, lengths, last_tokens))
        self.table.grow(batch.row_ids)  # the step wrote one position per row: now part of each row
        return _pick(logits, masks)

    def _decode_rows(self, batch: SlotBatch, starts: list[int], lengths: list[int], tokens: list[int]) -> Any:
        read = sum(lengths) + len(lengths)
        if self.threads is not None:
            self.threads(read, "decode")
        device = self.cache.keys[0].device
        positions = torch.tensor(lengths, device=device)
        cache = self.cache
        cache.rows, cache.write, cache.view = None, torch.tensor(starts, device=device) + positions, None
        cache.extent = None
        ids = torch.tensor(tokens, device=device).unsqueeze(1)
        pairs = [(start, length + 1) for start, length in zip(starts, lengths, strict=True)]
        with row_attention.per_row(self.language.config, pairs):
            hidden = self.language(
                inputs_embeds=self.language.get_input_embeddings()(ids),
                position_ids=positions.unsqueeze(1),
                cache=self.cache,
                use_cache=True,
            ).last_hidden_state
        batch.read, batch.padding = read, 0
        return self.model.lm_head(hidden[:, -1])

    def _decode_fixed(
        self, batch: SlotBatch, starts: list[int], lengths: list[int], tokens: list[int]
    ) -> Any:
        table = self.table
        slots = [start // self.cache.stride for start in starts]  # the uniform grid's slots
        step = self.step(rows_bucket(table.top, table.slots), width_bucket(max(lengths) + 1, table.positions))
        assert isinstance(step, FixedStep)
        if self.threads is not None:
            self.threads(step.slots * step.width, "decode")
        step.fill(slots, lengths, tokens)
        logits = step.run()
        batch.read = step.slots * step.width
        batch.padding = batch.read - (sum(lengths) + len(lengths))
        return logits.index_select(0, torch.tensor(slots, device=logits.device))

    def _decode_pool(self, batch: SlotBatch, starts: list[int], lengths: list[int], tokens: list[int]) -> Any:
        table = self.table
        reach = max(start + length + 1 for start, length in zip(starts, lengths, strict=True))
        rows = pool_step.step_rows(len(starts), table.slots, self.cache.keys[0].device)
        step = self.step(rows, pool_step.extent_bucket(reach, table.pool, table.grain))
        assert isinstance(step, pool_step.PoolStep)
        if self.threads is not None:
            self.threads(step.rows * step.extent, "decode")
        step.fill(starts, lengths, tokens)
        logits = step.run()
        batch.read = step.extent  # its keys and values, read once for all the rows
        batch.padding = batch.read - (sum(lengths) + len(lengths))
        return logits[: len(starts)]

    def _compact(self) -> None:
        """Rows moved down into free room when that shrinks the step's bucket (of slots covered; of
        the pool's positions read): one copy of each moved row, instead of every later step covering
        the holes below a row placed high (never when only retained slots lie below it: compaction
        would move nothing, every step)."""
        table = self.table
        if self.decode_mode == "pool":
            bucket = lambda reach: pool_step.extent_bucket(reach, table.pool, table.grain)  # noqa: E731
            # It copies at most the extent's positions (each read and written once); a bucket less saves
            # at least 29 % of every later step's reads: it pays back within about seven steps.
            if table.reach and bucket(table.reach) > bucket(table.packed_reach):
                table.compact()
        elif rows_bucket(table.top, table.slots) > rows_bucket(table.packed_top, table.slots):
            table.compact()  # the table hands each move to the cache (SlotTable.mover)

    def step(self, first: int, second: int) -> StaticStep:
        """The fixed-shape step of this shape (made on first use; captured ones at warm-up): `fixed`,
        (slots, width); `pool`, (rows, extent)."""
        key = (first, second)
        if key not in self._steps:
            if self.decode_mode == "pool":
                self._steps[key] = pool_step.PoolStep(self.model, self.cache, first, second)
            else:
                self._steps[key] = FixedStep(self.model, self.cache, first, second)
        return self._steps[key]

    @torch.inference_mode()
    def capture(self) -> int:
        """Record every bucket's fixed-shape step as a CUDA graph (one memory pool for all: they never
        run at once). Returns how many were captured."""
        pool = torch.cuda.graph_pool_handle()
        if self.decode_mode == "pool":
            shapes = pool_step.buckets(self.table.slots, self.table.pool, self.cache.keys[0].device)
        else:
            shapes = buckets(self.table.slots, self.table.positions)
        for first, second in shapes:
            self.step(first, second).capture(pool)
            self.captured += 1
        return self.captured


def _pick(logits: Any, masks: MaskFn | None) -> list[int]:
    """Greedy: each row's most likely token, among those its grammar allows where it has one; a row
    whose grammar allows no token at all (a dead end of its schema) gets DEAD_END instead."""
    bitmask = masks() if masks is not None else None
    if bitmask is None:
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    logits = grammar_masks.apply(logits, bitmask)
    best, tokens = logits.max(dim=-1)
    dead = torch.isneginf(best)
    return [DEAD_END if d else int(t) for t, d in zip(tokens.tolist(), dead.tolist(), strict=True)]


def _freeing_on_oom(call: Any) -> Any:
    """Out of memory is settled by the engine (fewer rows, then retry): give the allocator's cached
    blocks back first, so the retry sees the memory the failed call took."""
    try:
        return call()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise
