"""Model time on the CPU, alone and beside 1, 2 and 4 busy processes, per thread setting.

A CPU worker shares its cores with whatever else runs there (the demo's clients, a test session, a
small box's API). OpenMP threads that spin-wait for a core another process holds make a parallel model
step wait for its slowest thread; this measures it, for two calls: one ticket (the tiny Fuyu, NF4,
320x240, exactly 32 new tokens) and a batch (8 photos of 1024x768, exactly 16 new tokens). Each
setting runs in a fresh process (OpenMP reads its environment once, when torch loads):

- `worker`: what `mrc-worker` does (workers/cpu_threads.py: one thread for a small call, the cores for
  a large one, waits that sleep);
- `torch-default`: a thread per core, OpenMP's default (spinning) waits: what the worker did before;
- `cores-passive`: a thread per core, waits that sleep (OMP_WAIT_POLICY=PASSIVE).

    .venv/bin/python tests/bench/bench_cpu_contention.py [--runs 5] [--busy 0,1,2,4] [--json]

Prints, per call and setting, the median model time with N busy processes and its ratio to the same
setting alone. Goal: a ticket's model time beside two busy processes <= 2x alone.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CORES = str(len(os.sched_getaffinity(0)))
SETTINGS = {
    "worker": {},
    "torch-default": {"MRC_CPU_THREADS": CORES},  # torch loads before workers/ sets the wait policy
    "cores-passive": {"MRC_CPU_THREADS": CORES},
}
CALLS = {"ticket": (240, 320, 32, 1), "batch": (768, 1024, 16, 8)}  # height, width, new tokens, jobs


def _child(runs: int, call: str, setting: str) -> None:
    """In the measuring process: load the tiny Fuyu as the worker does, time one call `runs` times."""
    if setting != "torch-default":  # as in mrc-worker: OMP_WAIT_POLICY=PASSIVE before torch loads
        importlib.import_module("workers")
    import torch  # torch-default: OpenMP starts with its own default wait

    wait = "default" if setting == "torch-default" else os.environ["OMP_WAIT_POLICY"]

    from shared.settings import Settings
    from workers.backends import make_backend
    from workers.backends.base import GenerationInput
    from workers.backends.fuyu import torch_full_image

    height, width, tokens, jobs = CALLS[call]
    backend = make_backend(Settings(model="tiny", device="cpu", home=str(ROOT / ".cache" / "mrc")))
    backend.load()
    item = GenerationInput(
        torch_full_image(height, width), "Is the parcel damaged?", tokens, exact_steps=True
    )
    batch = [item] * jobs
    backend.generate(batch)  # warm; also sets the CPU threads as the worker does (MRC_CPU_THREADS)
    print("READY", flush=True)
    sys.stdin.readline()  # the parent starts the busy processes, then says go
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        backend.generate(batch)
        times.append(time.perf_counter() - began)
    threads = f"{torch.get_num_threads()} threads, {wait} wait"
    print(json.dumps({"median_s": statistics.median(times), "threads": threads}), flush=True)


def _measure(setting: str, call: str, busy: int, runs: int) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MRC_", "OMP_", "GOMP_"))}
    env.update(SETTINGS[setting])
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", call, "--setting", setting, "--runs", str(runs)],
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
    parser.add_argument("--calls", default=",".join(CALLS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--setting", default="worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.runs, args.child, args.setting)
        return 0
    counts = [int(n) for n in args.busy.split(",")]
    table: dict[str, dict[str, dict[int, float]]] = {}
    described: dict[str, object] = {}
    for call in args.calls.split(","):
        table[call] = {}
        for name in args.settings.split(","):
            table[call][name] = {}
            for busy in counts:
                result = _measure(name, call, busy, args.runs)
                table[call][name][busy] = float(result["median_s"])  # type: ignore[arg-type]
                described[f"{call}/{name}"] = result["threads"]
    if args.json:
        print(json.dumps({"seconds": table, "threads": described}, indent=2))
        return 0
    print(f"model time (tiny Fuyu, NF4, CPU, {CORES} cores), median of {args.runs}")
    print(f"{'call':<7} {'setting':<14} {'threads':<28} " + " ".join(f"{f'busy {n}':>16}" for n in counts))
    for call, rows in table.items():
        for name, row in rows.items():
            alone = row.get(0) or next(iter(row.values()))
            cells = " ".join(f"{row[n] * 1000:8.0f} ms {row[n] / alone:4.1f}x" for n in counts)
            print(f"{call:<7} {name:<14} {described[f'{call}/{name}']!s:<28} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
