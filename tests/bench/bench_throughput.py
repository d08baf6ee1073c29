"""Throughput and latency of the whole system against the bare model and the naive pipeline, over a
matrix of workloads (tests/bench/workloads.py), each row measured side by side in one run.

Real redis-server, moto S3 server, worker processes, tiny Fuyu (NF4, CPU).
  bare       the bare static loop: backend.run (generate()) over static model batches formed by
             tests/bench/static_batches.py (the worker's batcher before the engine), model time only
  bare+dec   the same loop with image decoding and preprocessing inside it (no queue, no S3)
  system     mrc-worker: deliveries on the threads pool, decode pool, device preprocessing, the
             iteration-level engine (MRC_MODEL_BATCH_MAX_JOBS = --batch rows), S3 results
  unbatched  mrc-worker with MRC_MODEL_BATCH_MAX_JOBS=1 (one row at a time) and deliveries of 2
  noreuse    mrc-worker with MRC_ENGINE_PREFIX_CACHE=off (every prefill whole: no photo reused)
  forget     mrc-worker that remembers nothing of a photo: prefix reuse off and MRC_DECODED_IMAGE_CACHE_MB=0
             (every job decodes its photo and prefills it whole)
  naive      one Celery task per job, PIL + FuyuProcessor, generate at batch 1, result to S3
The trickle row sends jobs one by one below capacity and reports latency (p50, p99) for system and
naive. For each system run it prints where the worker's time went (stages, time between deliveries).

With `--model parcels` (the trained tiny Fuyu, its own questions about its own photos: the `parcels`
workload) system and naive must also give the same answer to every job: its answers are confident, so
an answer that differs is a bug in one of the two paths, not noise. The run exits 1 if one does.

    .venv/bin/python tests/bench/bench_throughput.py [--jobs 48] [--batch 8] [--rows decode-heavy,...]
    .venv/bin/python tests/bench/bench_throughput.py --model parcels --parts system,naive
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set
from shared.jobs import parse_rfc3339  # noqa: E402 - after sys.path is set
from shared.settings import Settings  # noqa: E402 - after sys.path is set
from tests.bench.naive_runner import naive, rounds  # noqa: E402 - after sys.path is set
from tests.bench.workloads import PARCELS, WORKLOADS, Workload  # noqa: E402 - after sys.path is set

ENGINE_KEYS = ("slots", "slot_positions", "decode", "max_rows", "kv_tokens")  # now's and before's
BEFORE: dict[str, str] = {}  # --before's tree (and --pairs), and --rounds: what the rows read
GOALS = {  # system / naive
    "decode-heavy": 4.0,
    "prefill-heavy": 1.5,
    "mixed-new-tokens": 1.0,
    "mixed-sizes-16": 1.1,
    "mixed-sizes-64": 1.5,
}


def bare(wl: Workload, paths: list[Path], jobs: int, batch: int, env: dict[str, str]) -> dict[str, float]:
    """jobs/s of backend.run over the model batches the system's batcher forms (model only), and of
    the same loop with decoding and preprocessing inside it."""
    from tests.bench import static_batches as batching
    from workers import images
    from workers.backends.base import GenerationInput
    from workers.backends.fuyu import FuyuBackend

    settings = Settings(model=env["MRC_MODEL"], home=env["MRC_HOME"], quantization="nf4", device="cpu")
    backend = FuyuBackend(settings)
    backend.load()
    backend.warm_up()
    datas = [p.read_bytes() for p in paths]
    specs = [wl.job(i) for i in range(jobs)]
    tensors = {n: images.load(datas[n], 10**9).tensor for n in {s[0] for s in specs}}
    costs = []
    for n, prompt, new in specs:
        plan = backend.plan_prompt(prompt, settings.max_prompt_tokens, truncate=True)
        image = backend.image_tokens(tensors[n].shape[1], tensors[n].shape[2])
        costs.append(batching.Cost(image + plan.tokens, new))
    groups = batching.form_batches(costs, batch, settings.batch_token_budget, settings.batch_max_padding)

    def inputs(group: list[int], fresh: bool) -> list[GenerationInput]:
        return [
            GenerationInput(
                images.load(datas[specs[i][0]], 10**9).tensor if fresh else tensors[specs[i][0]],
                specs[i][1],
                specs[i][2],
            )
            for i in group
        ]

    prepared = [backend.prepare(inputs(g, fresh=False)) for g in groups]
    began = time.perf_counter()
    for p in prepared:
        backend.run(p)
    model_only = jobs / (time.perf_counter() - began)
    began = time.perf_counter()
    for g in groups:
        backend.generate(inputs(g, fresh=True))
    return {
        "bare": model_only,
        "bare+dec": jobs / (time.perf_counter() - began),
        "model_batches": len(groups),
    }


def _breakdown(worker: services.Worker, wall: float) -> str:
    """Where the worker's time went: its stage timings summed over deliveries, and the rest."""
    stages: dict[str, float] = {}
    in_batches = 0.0
    for line in worker.find("MRC_BATCH"):
        in_batches += float(line["seconds"])
        for part in line.get("stages", "").split(","):
            if ":" in part:
                name, ms = part.split(":")
                stages[name] = stages.get(name, 0.0) + float(ms) / 1000
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(stages.items(), key=lambda kv: -kv[1]))
    deliveries = len(worker.find("MRC_BATCH"))
    # Deliveries overlap (the threads pool): their stage times sum to more than the wall time.
    images = _fetches(worker)
    return f"wall {wall:.2f} s; {deliveries} deliveries, stage seconds summed over them: {parts}{images}"


def _fetches(worker: services.Worker) -> str:
    """How the jobs' images came (the worker's mrc_image_fetches_total): from S3, shared with another
    job's fetch in the delivery, or a kept photo not fetched; empty for a worker without the counter."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.http_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except (OSError, IndexError):
        return ""
    counts = [line.split('"')[1] + " " + line.split()[-1].removesuffix(".0") for line in text.splitlines()
              if line.startswith("mrc_image_fetches_total{")]  # fmt: skip
    return f"; images {', '.join(counts)}" if counts else ""


def system(
    wl: Workload, paths: list[Path], jobs: int, work: Path, env: dict[str, str], batch: int, tag: str
) -> dict[str, Any]:
    from producer.client import Client, Submission

    worker_env = {  # deliveries of two model batches (unless --worker-env says otherwise)
        **env,
        "MRC_BATCH_MAX_JOBS": str(2 * batch) if batch == 1 else env.get("MRC_BATCH_MAX_JOBS", str(2 * batch)),
        "MRC_MODEL_BATCH_MAX_JOBS": str(batch),
        "MRC_BATCH_WAIT_MS": env.get("MRC_BATCH_WAIT_MS", "50"),
    }
    worker = services.start_worker(worker_env, work / f"worker-{wl.name}-{tag}.log")
    try:
        client = Client(services.settings_from_env(env))
        built = []
        for i in range(jobs):
            n, prompt, new = wl.job(i)
            submission = Submission(
                image=paths[n], prompt=prompt, max_new_tokens=new, job_id=f"{wl.name}-{tag}-{i}"
            )
            built.append(client.build_job(submission))
        began = time.perf_counter()
        sent: dict[str, float] = {}
        for job in built:
            sent[job.job_id] = time.time()  # not the job's submitted_at: built before the trickle began
            client.enqueue(job)
            if wl.trickle_per_s:
                time.sleep(1 / wl.trickle_per_s)
        latencies, texts = [], []
        reused = prompt = 0
        for job in built:
            result = client.wait(job.job_id, 900)
            assert result["status"] == "succeeded", result
            assert not result.get("cache_hit"), "a cached answer is not a measurement"
            latencies.append(parse_rfc3339(result["finished_at"]).timestamp() - sent[job.job_id])
            texts.append(result["text"])
            usage = result.get("usage") or {}
            reused += int(usage.get("cached_tokens", 0))
            prompt += int(usage.get("prompt_tokens", 0))
        wall = time.perf_counter() - began
        ready = worker.find("MRC_ENGINE_READY")
        return {
            "rate": jobs / wall,
            "latencies": latencies,
            "texts": texts,
            "breakdown": _breakdown(worker, wall),
            "reused": f"{reused} ({reused / max(1, prompt):.0%})",
            "engine": " ".join(f"{k}={v}" for k, v in ready[0].items() if k in ENGINE_KEYS)
            if ready
            else "static batches",
        }
    finally:
        worker.stop()


def alternate(
    wl: Workload, paths: list[Path], jobs: int, work: Path, env: dict[str, str], batch: int, pairs: int
) -> dict[str, float]:
    """This tree's worker and --before's, `pairs` times, the order swapped every pair (the second run
    of a pair is often the faster: a one-sided order would be a one-sided result). Prints each run's
    wall time; returns the two geometric means of jobs/s as "system" and "before"."""
    rates: dict[str, list[float]] = {"system": [], "before": []}
    for pair in range(pairs):
        order = ("system", "before") if pair % 2 == 0 else ("before", "system")
        for part in order:
            run_env = {**env, "PYTHONPATH": BEFORE["tree"]} if part == "before" else env
            rate = system(wl, paths, jobs, work, run_env, batch, f"{part[:3]}{pair}")["rate"]
            rates[part].append(rate)
            print(f"  [{wl.name}] pair {pair + 1} {part}: wall {jobs / rate:.2f} s", flush=True)
    return {part: math.exp(sum(math.log(r) for r in got) / len(got)) for part, got in rates.items()}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _rounds(
    row: dict[str, Any],
    wl: Workload,
    paths: list[Path],
    jobs: int,
    work: Path,
    env: dict[str, str],
    batch: int,
    parts: set[str],
) -> set[str]:
    """--rounds: the system and the naive pipeline alternating (their rates and the ratio's spread into
    `row`; answers are not compared); the parts left to run."""
    if not {"system", "naive"} <= parts or int(BEFORE.get("rounds") or 0) < 2 or wl.trickle_per_s:
        return parts
    specs = [wl.job(i) for i in range(jobs)]
    row.update(
        rounds(
            lambda tag: system(wl, paths, jobs, work, env, batch, tag)["rate"],
            lambda: naive(env, specs, paths, work, 0)[0],
            int(BEFORE["rounds"]),
            wl.name,
        )
    )
    return parts - {"system", "naive"}


def run_row(
    wl: Workload, jobs: int, batch: int, work: Path, env: dict[str, str], parts: set[str]
) -> dict[str, Any]:
    paths = wl.make_images(work)
    row: dict[str, Any] = {"workload": wl.name, "jobs": jobs}
    if "bare" in parts and not wl.trickle_per_s:
        row.update(bare(wl, paths, jobs, batch, env))
    parts = _rounds(row, wl, paths, jobs, work, env, batch, parts)
    if "system" in parts:
        measured = system(wl, paths, jobs, work, env, batch, "sys")
        row["system"] = measured["rate"]
        row["system_p50"], row["system_p99"] = (
            _pct(measured["latencies"], 0.5),
            _pct(measured["latencies"], 0.99),
        )
        row["breakdown"], row["engine"] = measured["breakdown"], measured["engine"]
        row["reused"] = measured["reused"]
        print(f"  [{wl.name}] system: {measured['breakdown']}; {measured['engine']}", flush=True)
    if "before" in parts and BEFORE.get("tree") and BEFORE.get("pairs"):  # --pairs: alternating runs
        row.update(alternate(wl, paths, jobs, work, env, batch, int(BEFORE["pairs"])))
    elif "before" in parts and BEFORE.get("tree"):  # the same system from another tree (--before)
        measured = system(wl, paths, jobs, work, {**env, "PYTHONPATH": BEFORE["tree"]}, batch, "bef")
        row["before"] = measured["rate"]
        row["before_p50"], row["before_p99"] = (
            _pct(measured["latencies"], 0.5),
            _pct(measured["latencies"], 0.99),
        )
    if "noreuse" in parts:
        off = system(wl, paths, jobs, work, {**env, "MRC_ENGINE_PREFIX_CACHE": "off"}, batch, "off")
        row["noreuse"] = off["rate"]
        print(f"  [{wl.name}] noreuse: {off['breakdown']}", flush=True)
    if "forget" in parts:
        off = {**env, "MRC_ENGINE_PREFIX_CACHE": "off", "MRC_DECODED_IMAGE_CACHE_MB": "0"}
        row["forget"] = system(wl, paths, jobs, work, off, batch, "fgt")["rate"]
    if "unbatched" in parts and not wl.trickle_per_s:
        row["unbatched"] = system(wl, paths, jobs, work, env, 1, "one")["rate"]
    if "naive" in parts:
        rate, latencies, texts = naive(env, [wl.job(i) for i in range(jobs)], paths, work, wl.trickle_per_s)
        row["naive"], row["naive_p50"], row["naive_p99"] = rate, _pct(latencies, 0.5), _pct(latencies, 0.99)
        if "system" in parts:
            exact = env.get("MRC_QUANTIZATION", "nf4") == "fp32"
            row["answers_differ"] = _compare_answers(wl, measured["texts"], texts, exact)
    return row


def _compare_answers(wl: Workload, system_texts: list[str], naive_texts: list[str], exact: bool) -> int:
    """Jobs whose answers differ between the system and the naive pipeline (printed)."""
    differ = [i for i, (a, b) in enumerate(zip(system_texts, naive_texts, strict=True)) if a != b]
    for i in differ:
        print(f"  [{wl.name}] job {i} {wl.job(i)}: system {system_texts[i]!r}, naive {naive_texts[i]!r}")
    print(
        f"  [{wl.name}] answers: {len(system_texts) - len(differ)}/{len(system_texts)} the same", flush=True
    )
    if differ and not exact:
        # Not the oracle: in half precision a row's rounding follows its neighbours (docs/design.md).
        print(f"  [{wl.name}] (half precision: rows beside others may round otherwise than alone; "
              "--worker-env MRC_QUANTIZATION=fp32 checks the answers exactly)", flush=True)  # fmt: skip
    return len(differ)


def _cell(row: dict[str, Any]) -> Any:
    return lambda key: f"{row[key]:.2f}" if key in row else "-"


def report(rows: list[dict[str, Any]]) -> None:
    print("\n| workload | system jobs/s | before | naive | unbatched | bare | bare+dec | "
          "system/naive (goal) | before/naive | system/bare+dec (goal 0.85) | p50 / p99 s system | "
          "p50 / p99 s before | p50 / p99 s naive |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f = _cell(r)
        ratio = (
            f"{r['system'] / r['naive']:.2f} ({GOALS.get(r['workload'], 1.0)})"
            if "naive" in r and "system" in r
            else "-"
        )
        vs_bare = f"{r['system'] / r['bare+dec']:.2f}" if "bare+dec" in r and "system" in r else "-"
        lat_sys = f"{r['system_p50']:.2f} / {r['system_p99']:.2f}" if "system_p50" in r else "-"
        lat_naive = f"{r['naive_p50']:.2f} / {r['naive_p99']:.2f}" if "naive_p50" in r else "-"
        lat_before = f"{r['before_p50']:.2f} / {r['before_p99']:.2f}" if "before_p50" in r else "-"
        before = f"{r['before'] / r['naive']:.2f}" if "naive" in r and "before" in r else "-"
        print(f"| {r['workload']} | {f('system')} | {f('before')} | {f('naive')} | {f('unbatched')} | "
              f"{f('bare')} | {f('bare+dec')} | {ratio} | {before} | {vs_bare} | {lat_sys} | {lat_before} | "
              f"{lat_naive} |")  # fmt: skip
    reuse = [r for r in rows if "noreuse" in r and "system" in r]
    if reuse:
        print("\n| workload | system jobs/s | prefix reuse off | system / reuse off | remembers nothing | "
              "system / remembers nothing | system / naive | "
              "positions reused (share of prompt positions) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for r in reuse:
            naive = f"{r['system'] / r['naive']:.2f}" if "naive" in r else "-"
            forget = f"{r['forget']:.2f} | {r['system'] / r['forget']:.2f}" if "forget" in r else "- | -"
            print(f"| {r['workload']} | {r['system']:.2f} | {r['noreuse']:.2f} | "
                  f"{r['system'] / r['noreuse']:.2f} | {forget} | {naive} | "
                  f"{r.get('reused', '-')} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description="mrc throughput: system vs bare model vs naive, per workload"
    )
    parser.add_argument("--jobs", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8, help="MRC_MODEL_BATCH_MAX_JOBS for the system runs")
    parser.add_argument(
        "--rows", default=",".join([*WORKLOADS, "mixed-load"]), help="workloads to run (all by default)"
    )
    parser.add_argument("--parts", default="bare,system,unbatched,naive", help="which runs (all by default)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    parser.add_argument(
        "--before", help="a checkout of an earlier commit: its worker runs each row too (part 'before')"
    )
    parser.add_argument(
        "--pairs", type=int, default=0, help="with --before: N pairs of runs, order swapped each pair"
    )
    parser.add_argument(
        "--rounds", type=int, default=0, help="system and naive N times each, alternating: the ratio's spread"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (worker logs)")
    parser.add_argument("--worker-env", action="append", default=[], help="KEY=VALUE for the mrc-worker runs")
    parser.add_argument(
        "--model",
        default="tiny",
        choices=("tiny", "parcels"),
        help="parcels: the `parcels` row, answers compared",
    )
    args = parser.parse_args()
    if args.model == "parcels" and "--rows" not in sys.argv:
        args.rows = PARCELS.name
    parts = set(args.parts.split(","))
    BEFORE["rounds"] = str(args.rounds)
    if args.before:
        BEFORE["tree"] = str(Path(args.before).resolve())
        BEFORE["pairs"] = str(args.pairs) if args.pairs > 0 else ""
        parts.add("before")
    logs.configure("WARNING")
    work = Path(tempfile.mkdtemp(prefix="mrc-bench-"))
    redis = services.start_redis(work / "redis")
    s3 = services.start_s3(work / "s3")
    rows = []
    try:
        env = services.base_env(redis.url, s3.url, "mrc-bench", ROOT / ".cache" / "mrc")
        # The same images recur across runs: with the cache on, later runs would be answered from
        # the earlier ones' results.
        env["MRC_CACHE_TTL_S"] = "0"
        env["MRC_MODEL"] = args.model
        env.update(dict(item.split("=", 1) for item in args.worker_env))
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
        mixed_load = None
        for name in args.rows.split(","):
            if name == "mixed-load":  # tickets beside a backlog run: tests/bench/bench_mixed_load.py
                from tests.bench import bench_mixed_load as mixed

                print("mixed-load: tickets beside a backlog run ...", flush=True)
                mixed_args = mixed.parser().parse_args([])
                mixed_load = mixed.measure(mixed_args, env, mixed.IMAGES.make_images(work), work, "matrix")
                continue
            wl = PARCELS if name == PARCELS.name else WORKLOADS[name]
            jobs = min(args.jobs, 32) if wl.trickle_per_s else args.jobs
            print(f"{name}: {jobs} jobs ...", flush=True)
            rows.append(run_row(wl, jobs, args.batch, work, env, parts))
        report(rows)
        if mixed_load is not None:
            mixed.print_row(mixed_args, mixed_load)
        worker_env = args.worker_env or "defaults"
        model, quantization = env["MRC_MODEL"], env.get("MRC_QUANTIZATION", "nf4")
        print(f"(batch={args.batch}, model {model}, {quantization} on the CPU, worker env {worker_env})")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        differ = sum(r.get("answers_differ", 0) for r in rows)
        if differ and (args.model == "parcels" or "parcels" in env["MRC_MODEL"]):
            raise SystemExit(f"{differ} answers differ between the system and the naive pipeline")
    finally:
        redis.stop()
        s3.stop()
        if args.keep:
            print(f"work folder: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
