"""The iteration-level engine: jobs join and leave one running batch at every decode step.

    sequence.py   one row's state (what it asked for, what it generated, why it ended, when)
    scheduler.py  who is admitted, paused or held at the next step: pure (no torch, no clock)
    slot_table.py which row holds which slot of the cache and how many positions: pure Python
    prefix_index.py  which computed prefixes the cache holds, found by hash chains: pure Python
    kv.py         the cache itself (torch): slots allocated once, written in place; the running batch
    row_attention.py  the CPU's decode step: each row attends to its own length in its own slot
    fixed_step.py the GPU's decode step: one call of fixed shape per bucket, capturable
    pool_step.py  the same over slots by need: one call over the pool's used part, rows masked to their own
    step.py       the seam between the engine and a model (StepModel, RowBatch)
    runner.py     the only model calls: prefill chunks of rows, decode one step for every row
    embeddings.py a prefilling row's input embeddings, its photo's patches projected once
    masks.py      a call's grammar mask, one bitmask for the batch
    rows.py       the rows as the scheduler sees them; a batch emptied, a group halved
    engine.py     step(): admit -> prefill chunks -> one decode step -> retire
    settling.py   the rows in memory, and the per-row failure rules
    capacity.py   how many slots of how many positions fit, from free memory at warm-up
    service.py    the engine's own thread: delivery threads submit rows and wait on futures

The shape follows nano-vllm's engine (sequence / scheduler / block manager / model runner / engine).
The worker feeds it from workers/model_stage.py; docs/design.md, "Iteration-level engine".
"""
