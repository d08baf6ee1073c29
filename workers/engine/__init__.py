"""The iteration-level engine: jobs join and leave one running batch at every decode step.

    sequence.py   one row's state (what it asked for, what it generated, why it ended)
    scheduler.py  who is admitted at the next step: a pure function of the engine's state (no torch)
    kv.py         the running batch's KV cache: merge a prefilled row in, drop finished rows
    runner.py     the only model calls: prefill one job, decode one step for every running row
    engine.py     step(): admit -> one decode step -> retire, in a few lines

The shape follows nano-vllm's engine (sequence / scheduler / block manager / model runner / engine).
Not yet wired into the worker (the pipeline still runs model batches through `generate()`): see
docs/design.md, "Iteration-level engine".
"""
