"""The whole bad-input corpus through the real worker, in one go: each case gets its own clear outcome,
and its neighbours in the same batch are unharmed."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from producer.client import Client
from scripts.devservices import Worker
from shared.errors import UsageError
from tests.support import badcorpus, imagegen

pytestmark = pytest.mark.integration


def _wait(client: Client, job_ids: list[str], timeout: float = 120) -> dict[str, dict]:
    deadline, results = time.monotonic() + timeout, {}
    while len(results) < len(job_ids) and time.monotonic() < deadline:
        for job_id in job_ids:
            if job_id not in results and (result := client.result(job_id)) is not None:
                results[job_id] = result
        time.sleep(0.2)
    assert len(results) == len(job_ids), sorted(set(job_ids) - set(results))
    return results


def test_bad_images_each_get_their_code_and_spare_their_neighbours(
    client: Client, worker: Worker, tmp_path: Path
) -> None:
    badcorpus.write(tmp_path)
    good = tmp_path / "good.jpg"
    good.write_bytes(imagegen.photo(320, 240))
    tag = uuid.uuid4().hex[:6]
    peak_before = _peak_rss_mb(worker)
    expected: dict[str, str | None] = {}
    for name, (_data, code) in badcorpus.images().items():  # backlog jobs: they share deliveries
        bad_id, good_id = f"bad-{tag}-{name}", f"good-{tag}-{name}"
        expected[client.submit(tmp_path / name, "is it damaged?", job_id=bad_id, lane="backlog")] = code
        expected[client.submit(good, "is it damaged?", job_id=good_id, lane="backlog")] = None
    results = _wait(client, list(expected))
    outcome = {job_id: (r["error"] or {}).get("code") for job_id, r in results.items()}
    assert outcome == expected
    for job_id, result in results.items():
        assert (result["status"] == "succeeded") is (expected[job_id] is None)
        assert result["error"] is None or result["error"]["message"]
        if expected[job_id] == "image_too_large":  # refused from its header, whose size it names
            size = f"{result['image']['width']}x{result['image']['height']}"
            assert size in result["error"]["message"], (size, result["error"]["message"])
    # The frame bombs alone would have cost 1.2 GB (and 216 GB) if any decoder had drawn their frames.
    assert _peak_rss_mb(worker) - peak_before < 400, "the worker's peak memory grew on the bad corpus"
    assert worker.proc.poll() is None


def _peak_rss_mb(worker: Worker) -> float:
    for line in Path(f"/proc/{worker.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc status")


def test_bad_prompts_are_refused_or_answered(client: Client, worker: Worker, tmp_path: Path) -> None:
    image = tmp_path / "p.jpg"
    image.write_bytes(imagegen.photo(160, 120))
    accepted = []
    for name, (prompt, refused) in badcorpus.prompts().items():
        if refused:
            with pytest.raises(UsageError):
                client.submit(image, prompt)
        else:
            accepted.append(
                (client.submit(image, prompt, job_id=f"prompt-{uuid.uuid4().hex[:6]}-{name}"), prompt)
            )
    results = _wait(client, [job_id for job_id, _ in accepted])
    for job_id, prompt in accepted:
        assert results[job_id]["status"] == "succeeded"
        assert results[job_id]["prompt"]["chars"] == len(prompt)
        lines = worker.logged("MRC_SUCCESS", job_id=job_id)
        assert len(lines) == 1
        assert lines[0]["prompt_head"] == prompt[:64]


def test_submit_many_from_python(client: Client, worker: Worker, tmp_path: Path) -> None:
    from producer.client import Submission

    image = tmp_path / "many.jpg"
    image.write_bytes(imagegen.photo(200, 160))
    tag = uuid.uuid4().hex[:6]
    subs = [
        Submission(image=image, prompt=f"q{i}", job_id=f"many-{tag}-{i}", ticket_id=f"T{i}") for i in range(3)
    ]
    ids = client.submit_many(subs)
    assert ids == [s.job_id for s in subs]
    results = _wait(client, ids)
    assert [results[i]["ticket_id"] for i in ids] == ["T0", "T1", "T2"]
