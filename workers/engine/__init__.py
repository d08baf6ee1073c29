"""The iteration-level engine: jobs join and leave one running batch at every decode step.

    sequence.py   one row's state (what it asked for, what it generated, why it ended, when)
    scheduler.py  who is admitted, paused or held at the next step: pure (no torch, no clock)
    kv.py         the running batch's KV cache: merge prefilled rows in, drop finished rows, split
    runner.py     the only model calls: prefill rows of one length, decode one step for every row
    engine.py     step(): admit -> one decode step -> retire, and the per-row failure rules
    capacity.py   cache positions from free memory at warm-up
    service.py    the engine's own thread: delivery threads submit rows and wait on futures

The shape follows nano-vllm's engine (sequence / scheduler / block manager / model runner / engine).
The worker feeds it from workers/model_stage.py; docs/design.md, "Iteration-level engine".
"""
