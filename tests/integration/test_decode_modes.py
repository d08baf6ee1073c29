"""A worker started with MRC_ENGINE_DECODE=pool (slots by need, one call of fixed shape a step) serves
jobs of several photo sizes at once and answers what the CPU's default step (`rows`) answers."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from scripts import devservices as services
from tests.support import imagegen

pytestmark = pytest.mark.integration

JOBS = [((90, 60), "Refund?"), ((320, 240), "Is the parcel damaged?"), ((160, 200), "What is on the label?")]


def _answers(env: dict[str, str], tmp_path: Path, decode: str) -> tuple[list[str], str]:
    """The texts a worker of this decode mode gives the JOBS submitted together, and its /readyz mode."""
    redis = services.start_redis(tmp_path / f"redis-{decode}")  # its own queue: no other worker takes them
    env = {**env, "MRC_REDIS_URL": redis.url, "MRC_ENGINE_DECODE": decode, "MRC_QUANTIZATION": "fp32"}
    worker = services.start_worker(env, tmp_path / f"{decode}.log")
    try:
        ready = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{worker.http_port}/readyz").read())
        submits = []
        for index, ((width, height), prompt) in enumerate(JOBS):
            image = tmp_path / f"{decode}-{index}.png"
            image.write_bytes(imagegen.photo(width, height))
            job_id = f"decode-{decode}-{index}-{tmp_path.name[-8:]}"
            out, err = tmp_path / f"{job_id}.out", tmp_path / f"{job_id}.err"
            submit = services.start_cli(
                env, "submit", "--image", str(image), "--prompt", prompt, "--job-id", job_id,
                "--max-new-tokens", "12", "--wait", "--timeout", "120", stdout=out, stderr=err,
            )  # fmt: skip
            submits.append((submit, out, err))
        texts = []
        for submit, out, err in submits:
            assert submit.wait(180) == 0, err.read_text()
            result = json.loads(out.read_text())
            assert result["status"] == "succeeded", result
            texts.append(result["text"])
        return texts, str(ready.get("engine_decode"))
    finally:
        worker.stop()
        redis.stop()


def test_the_pool_step_answers_what_the_rows_step_answers(env: dict[str, str], tmp_path: Path) -> None:
    pooled, mode = _answers(env, tmp_path, "pool")
    assert mode == "pool"
    rows, mode = _answers(env, tmp_path, "rows")
    assert mode == "rows"
    assert pooled == rows
