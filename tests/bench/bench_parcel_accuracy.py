"""The parcels model's accuracy through the whole system, as a table for docs/benchmarks.md: the run of
tests/integration/test_parcel_accuracy.py (tests/support/parcel_accuracy.py) on more photos, with its
own Redis, S3 and workers (fp32 and NF4 on the CPU).

    .venv/bin/python tests/bench/bench_parcel_accuracy.py [--images 300] [--seed 970000000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from scripts import parcels  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set
from tests.support import parcel_accuracy  # noqa: E402 - after sys.path is set


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--seed", type=int, default=970_000_000, help="first seed (held out: below 10^9)")
    args = parser.parse_args()
    logs.configure("WARNING")
    home = ROOT / ".cache" / "mrc"
    with services.local_stack("mrc-bench-accuracy-", "mrc-bench", home) as env:
        envs = {q: parcel_accuracy.worker_env(env, q, db) for db, q in enumerate(("fp32", "nf4"), start=1)}
        folder = Path(tempfile.mkdtemp(prefix="mrc-bench-accuracy-"))
        with parcel_accuracy.workers(envs, folder):
            run = parcel_accuracy.run(envs, args.images, args.seed, timeout=3600)
    print(
        f"\n{args.images} held-out photos (seeds {args.seed}..), {len(run.jobs)} jobs in {run.seconds:.0f} s"
    )
    print("| path | colour | damage | digit | agreement with fp32 (colour / damage / digit) |")
    print("|---|---|---|---|---|")
    for worker in envs:
        cells = [f"{run.accuracy(worker, kind):.1%}" for kind in parcels.KINDS]
        agree = " / ".join(f"{run.agreement(kind, 'fp32', worker):.1%}" for kind in parcels.KINDS)
        print(f"| free answers, {worker} | {' | '.join(cells)} | {agree if worker != 'fp32' else '-'} |")
    chosen = run.answers("fp32", "choice").values()
    valid = sum(r.get("output") in parcel_accuracy.CHOICES for r in chosen) / max(1, len(chosen))
    print(f"| `choice` of the six colours, fp32 | {run.accuracy('fp32', 'choice'):.1%} | - | - | "
          f"answers that are a choice: {valid:.0%} |")  # fmt: skip
    fields = [f"{run.accuracy('fp32', f'json.{name}'):.1%}" for name in ("colour", "damaged", "digit")]
    valid = sum(r.get("status") == "succeeded" for r in run.answers("fp32", "json").values()) / args.images
    print(f"| one JSON answer (schema), fp32 | {' | '.join(fields)} | valid JSON: {valid:.0%} |")


if __name__ == "__main__":
    main()
