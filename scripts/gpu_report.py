"""The GPU proving ground's last step (scripts/gpu_checks.sh): every step's figures and status in one
JSON file, and a short text summary of them. Standard library only: it must run whatever failed.

    python3 scripts/gpu_report.py WORK OUT_DIR MODE
WORK holds steps.tsv (name, exit code, seconds, limit, note per step) and each step's JSON part.
"""

from __future__ import annotations

import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

STATUS = {"0": "ok", "124": "timed out", "137": "timed out", "-": "skipped"}  # by exit code
PARTS = ("env", "preprocess", "grammar", "model", "step_cost", "prefill", "engine")


def steps(work: Path) -> list[dict[str, Any]]:
    out = []
    lines = (work / "steps.tsv").read_text().splitlines() if (work / "steps.tsv").is_file() else []
    for line in lines:
        name, rc, seconds, limit, note = (line.split("\t") + [""] * 5)[:5]
        status = "partly ready" if (name, rc) == ("env", "3") else STATUS.get(rc, "failed")
        out.append(
            {"step": name, "status": status, "rc": rc, "seconds": seconds, "limit_s": limit, "note": note}
        )
    return out


def tests(work: Path) -> dict[str, Any] | None:
    """pytest's JUnit XML: counts, and the name and message of each test that did not pass."""
    path = work / "tests_gpu.xml"
    if not path.is_file():
        return None
    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    assert suite is not None
    outcome: dict[str, Any] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    outcome["not_passed"] = [
        f"{case.get('name')}: {child.tag}: {(child.get('message') or '')[:200]}"
        for case in suite.iter("testcase")
        for child in case
        if child.tag in ("failure", "error")
    ]
    skips = [
        child.get("message") or ""
        for case in suite.iter("testcase")
        for child in case
        if child.tag == "skipped"
    ]
    outcome["skipped_because"] = {reason: skips.count(reason) for reason in dict.fromkeys(skips)}
    return outcome


def _load(work: Path, name: str) -> Any:
    path = work / f"{name}.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError as exc:  # a step cut short mid-write
        return {"unreadable": str(exc)}


def _lines_env(env: dict[str, Any]) -> list[str]:
    gpu, packages = env.get("gpu", {}), env.get("packages", {})
    versions = ", ".join(f"{k} {v.get('version')} ({v.get('from', '-')})" for k, v in packages.items())
    device = f"{gpu['name']} {gpu.get('memory_gib')} GiB" if gpu.get("name") else "none"
    return [
        f"GPU: {device}, torch CUDA {gpu.get('torch_cuda')}, bitsandbytes {gpu.get('bitsandbytes_library')}; "
        f"Python {env.get('python')}",
        f"packages: {versions}",
        f"bundle requirements unmet: {env.get('bundle_unmet') or 'none'}",
    ]


def _lines_model(model: dict[str, Any]) -> list[str]:
    out = []
    for mode in model.get("modes", []):
        rows = "; ".join(
            f"batch {b['batch']}: {b['images_per_s']} img/s, {b['tokens_per_s']} tok/s, "
            f"peak {b.get('peak_gib', '-')} GiB"
            + (f", roofline {b['roofline_fraction']}" if "roofline_fraction" in b else "")
            for b in mode.get("batches", [])
        )
        out.append(f"model {mode['mode']} ({mode.get('model_gib')} GiB, load {mode.get('load_s')} s): {rows}")
    return out


def _lines_engine(engine: dict[str, Any]) -> list[str]:
    out = []
    for run in engine.get("runs", []):
        by_rows = ", ".join(f"{r}: {v['wall_ms']} ms" for r, v in run.get("step_ms_by_rows", {}).items())
        window = run.get("kernel_window") or {}
        tickets = run.get("tickets", {})
        out.append(
            f"engine {run['run']}: {run.get('generated_tokens_per_s')} tok/s, {run.get('decode')} step, "
            f"rows {run.get('slots')} in a pool of {run.get('pool')} positions, "
            f"{run.get('mean_rows_per_decode_step')} rows a decode step, graphs {run.get('cuda_graphs')} in "
            f"{run.get('capture_s')} s; step by rows {{{by_rows}}}; GPU busy {window.get('gpu_busy_share')}; "
            f"tickets first token p50 {tickets.get('first_token_ms_p50')} ms, "
            f"p99 {tickets.get('first_token_ms_p99')} ms" + (" (cut short)" if run.get("cut_short") else "")
        )
    return out


def _lines_preprocess(pre: dict[str, Any]) -> list[str]:
    out = []
    for kind, row in pre.get("kinds", {}).items():
        batches = "; ".join(
            f"{k}: ours {v['ours_ms']} ms vs processor {v['processor_ms']} ms"
            for k, v in row.items()
            if k != "parity"
        )
        out.append(f"preprocess {kind}: {batches}; max abs diff {row['parity'].get('max_abs')}")
    return out


def _lines_grammar(grammar: dict[str, Any]) -> list[str]:
    compiled = ", ".join(f"{k} {v['cold']} ms" for k, v in grammar.get("compile_ms", {}).items())
    steps_ = "; ".join(
        f"{s['rows']} rows {s['state']}: fill {s['fill_ms']} + apply {s['apply_ms']} ms"
        for s in grammar.get("steps", [])
    )
    return [f"grammar ({grammar.get('vocab')} tokens, synthetic): compile cold {compiled}; {steps_}"]


def _lines_step_cost(cost: dict[str, Any]) -> list[str]:
    """One line per shape: each mode's step time (tests/bench/bench_step_cost.py)."""
    lines = [f"step cost ({cost.get('model')}, {cost.get('device')}), ms per decode step:"]
    for shape in cost.get("steps", []):
        modes = [f"{m} {v['ms']:.2f}" for m, v in shape.items() if isinstance(v, dict) and "ms" in v]
        lines.append(f"  {shape['shape']}: " + ", ".join(modes))
    return lines


def _lines_prefill(prefill: dict[str, Any]) -> list[str]:
    """A step's chunks in one call against one a row; a prompt whole, in chunks, as a prefix hit
    (tests/bench/bench_prefill.py)."""
    lines = [f"prefill ({prefill.get('model')}, {prefill.get('device')}), ms:"]
    for r in prefill.get("calls", []):
        lines.append(
            f"  {r['rows']} rows x {r['tail']} after a {r['prefix']}-position photo: one call a row "
            f"{r['each']:.2f}, one call for all {r['together']:.2f} ({r['together'] / r['each']:.2f})"
        )
    for r in prefill.get("prefill", []):
        chunks = [
            f"{'chunks' if k[:7] == 'chunks_' else 'masked chunks'} of {k[7:]} {v:.2f} ({v / r['whole']:.2f})"
            for k, v in r.items()
            if k[:7] in ("chunks_", "masked_")
        ]
        lines.append(f"  {r['positions']} positions: whole {r['whole']:.2f}, " + ", ".join(chunks)
                     + f", prefix hit {r['hit']:.2f}")  # fmt: skip
    return lines


def summary(report: dict[str, Any]) -> str:
    out = [f"GPU proving ground ({report['mode']}), {report['date']}"]
    out += [
        f"  {s['step']:<11} {s['status']:<9} {s['seconds']:>4} s (limit {s['limit_s']} s) {s['note']}"
        for s in report["steps"]
    ]
    if report.get("tests_gpu"):
        t = report["tests_gpu"]
        out.append(
            f"tests/gpu: {t['tests']} tests, {t['failures']} failed, {t['errors']} errors, "
            f"{t['skipped']} skipped"
        )
        out += [f"  {line}" for line in t["not_passed"][:10]]
        out += [f"  skipped ({count}): {reason}" for reason, count in t["skipped_because"].items()]
    writers = {"env": _lines_env, "model": _lines_model, "engine": _lines_engine}
    writers.update(
        {
            "preprocess": _lines_preprocess,
            "grammar": _lines_grammar,
            "step_cost": _lines_step_cost,
            "prefill": _lines_prefill,
        }
    )
    for name, write in writers.items():
        part = report.get(name)
        if not part:
            continue
        try:
            out += write(part)
        except (KeyError, TypeError, AttributeError) as exc:  # a partial part: say so, keep the rest
            out.append(f"{name}: partial figures ({type(exc).__name__}: {exc})")
    return "\n".join(out) + "\n"


def main() -> None:
    work, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    report: dict[str, Any] = {
        "mode": mode,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "steps": steps(work),
        "tests_gpu": tests(work),
    }
    report.update({name: _load(work, name) for name in PARTS})
    (out / "gpu-checks.json").write_text(json.dumps(report, indent=2, default=str))
    text = summary(report)
    (out / "summary.txt").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
