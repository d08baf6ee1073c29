"""The iteration-level engine: jobs join and leave one running batch at every decode step.

    sequence.py   one row's state (what it asked for, what it generated, why it ended, when)
    scheduler.py  who is admitted, paused or held at the next step: pure (no torch, no clock)
    slot_table.py which row holds which slot of the cache and how many positions: pure Python
    kv.py         the cache itself (torch): slots allocated once, written in place; the running batch
    row_attention.py  the CPU's decode step: each row attends to its own length in its own slot
    fixed_step.py the GPU's decode step: one call of fixed shape per bucket, capturable
    pool_step.py  the same over slots by need: one call over the pool's used part, rows masked to their own
    runner.py     the only model calls: prefill rows of one length, decode one step for every row
    engine.py     step(): admit -> one decode step -> retire, and the per-row failure rules
    capacity.py   how many slots of how many positions fit, from free memory at warm-up
    service.py    the engine's own thread: delivery threads submit rows and wait on futures

The shape follows nano-vllm's engine (sequence / scheduler / block manager / model runner / engine).
The worker feeds it from workers/model_stage.py; docs/design.md, "Iteration-level engine".
"""
