"""One job's model time on the CPU, alone and beside 1, 2 and 4 busy processes, per thread setting.

A CPU worker shares its cores with whatever else runs there (the demo's clients, a test session, a
small box's API). OpenMP threads that spin-wait for a core another process holds make a parallel
model step wait for the slowest thread; this measures it. Each setting runs in a fresh process
(OpenMP reads its environment once, when torch loads):

- `worker`: what `mrc-worker` does on the CPU (workers/cpu_threads.py: one thread for a small model);
- `torch-default`: torch's own defaults (one thread per core, spinning waits), what the worker did before.

    .venv/bin/python tests/bench/bench_cpu_contention.py [--runs 5] [--busy 0,1,2,4] [--json]

Prints, per setting, the median model time of one job (tiny Fuyu, NF4, 320x240, 32 new tokens) with
N busy processes and its ratio to the same setting alone. Goal: <= 2x alone beside two busy processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SETTINGS = {
    "worker": {},  # mrc-worker's own choice (workers/cpu_threads.py)
    # torch's defaults: a thread per core, OpenMP's default (spinning) wait, as the worker did before
    "torch-default": {"MRC_CPU_THREADS": str(len(os.sched_getaffinity(0)))},
    # a thread per core, but waits that sleep: what the worker does for a large model
    "cores-passive": {"MRC_CPU_THREADS": str(len(os.sched_getaffinity(0)))},
}


def _child(runs: int, setting: str) -> None:
    """In the measuring process: load the tiny Fuyu as the worker does, time one job `runs` times."""
    if setting == "torch-default":
        import torch  # before workers/ sets OMP_WAIT_POLICY: OpenMP keeps its own default

    from shared.settings import Settings
    from workers.backends import make_backend
    from workers.backends.base import GenerationInput
    from workers.backends.fuyu import torch_full_image

    settings = Settings(model="tiny", device="cpu", home=str(ROOT / ".cache" / "mrc"))
    backend = make_backend(settings)
    backend.load()  # sets the CPU threads as the worker does (MRC_CPU_THREADS, workers/cpu_threads.py)
    job = [GenerationInput(torch_full_image(240, 320), "Is the parcel damaged?", 32, exact_steps=True)]
    backend.generate(job)  # warm
    print("READY", flush=True)
    sys.stdin.readline()  # the parent starts the busy processes, then says go
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        backend.generate(job)
        times.append(time.perf_counter() - began)
    import torch

    wait = "default" if setting == "torch-default" else os.environ.get("OMP_WAIT_POLICY", "")
    threads = f"{torch.get_num_threads()} threads, {wait} wait"
    print(json.dumps({"median_s": statistics.median(times), "threads": threads}), flush=True)


def _measure(setting: str, busy: int, runs: int) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MRC_", "OMP_", "GOMP_"))}
    env.update(SETTINGS[setting])
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", setting, "--runs", str(runs)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None
    assert child.stdin is not None
    while (line := child.stdout.readline()) and line.strip() != "READY":
        pass
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(0.5 if busy else 0)  # the spinners are running
        child.stdin.write("go\n")
        child.stdin.flush()
        result = json.loads(child.stdout.readline())
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        child.wait(60)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--busy", default="0,1,2,4")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.runs, args.child)
        return 0
    counts = [int(n) for n in args.busy.split(",")]
    table: dict[str, dict[int, float]] = {}
    described: dict[str, object] = {}
    for name in args.settings.split(","):
        table[name] = {}
        for busy in counts:
            result = _measure(name, busy, args.runs)
            table[name][busy] = float(result["median_s"])  # type: ignore[arg-type]
            described[name] = result["threads"]
    if args.json:
        print(json.dumps({"seconds": table, "threads": described}, indent=2))
        return 0
    print(f"one job's model time (tiny Fuyu, NF4, CPU, {os.cpu_count()} cores), median of {args.runs}")
    print(f"{'setting':<15} {'threads':<28} " + " ".join(f"{f'busy {n}':>16}" for n in counts))
    for name, row in table.items():
        alone = row.get(0) or next(iter(row.values()))
        cells = " ".join(f"{row[n] * 1000:8.0f} ms {row[n] / alone:4.1f}x" for n in counts)
        print(f"{name:<15} {described[name]!s:<28} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
