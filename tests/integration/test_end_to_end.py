"""Jobs through the CLI, a real Redis, a real S3 endpoint and a real worker process."""

from __future__ import annotations

import hashlib
import json
import urllib.request
import uuid
from pathlib import Path

import boto3
import pytest

from scripts import devservices as services
from scripts.devservices import Worker, run_cli
from shared.jobs import JobResult
from tests.support import imagegen

pytestmark = pytest.mark.integration


def _s3(env: dict[str, str]):
    return boto3.client(
        "s3",
        endpoint_url=env["MRC_S3_ENDPOINT_URL"],
        region_name="us-east-1",
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )


def _write(tmp: Path, name: str, data: bytes) -> Path:
    path = tmp / name
    path.write_bytes(data)
    return path


def _submit_wait(env: dict[str, str], image: Path | str, prompt: str, *extra: str):
    return run_cli(
        env, "submit", "--image", str(image), "--prompt", prompt, "--wait", "--timeout", "120", *extra
    )


def test_jobs_succeed_with_one_result_object_each(env, worker: Worker, images_dir: Path) -> None:
    prompts = ["Can I get a refund for this damaged parcel?", "这个包裹坏了，我可以退款吗？"]
    for i, prompt in enumerate(prompts):
        image = _write(images_dir, f"p{i}.jpg", imagegen.photo(640 + 100 * i, 480, seed=i))
        job_id = f"e2e-{uuid.uuid4().hex[:10]}"
        done = _submit_wait(env, image, prompt, "--job-id", job_id, "--ticket-id", f"T-{i}")
        assert done.returncode == 0, done.stderr
        printed = json.loads(done.stdout)
        stored = json.loads(
            _s3(env).get_object(Bucket=env["MRC_S3_BUCKET"], Key=f"results/{job_id}.json")["Body"].read()
        )
        assert printed == stored
        JobResult.model_validate(stored)
        assert stored["schema"] == "mrc.result/1"
        assert stored["status"] == "succeeded"
        assert isinstance(stored["text"], str)
        assert stored["error"] is None
        assert stored["ticket_id"] == f"T-{i}"
        assert stored["attempts"] == 1
        assert stored["image"]["width"] == 640 + 100 * i
        assert stored["image"]["height"] == 480
        assert stored["image"]["uri"].startswith(f"s3://{env['MRC_S3_BUCKET']}/inputs/")
        assert stored["prompt"]["chars"] == len(prompt)
        assert stored["prompt"]["tokens"] > 0
        assert stored["model"]["id"] == "tiny-fuyu-v1"
        assert stored["model"]["quantization"] == "nf4"
        assert stored["model"]["attention_backend"] == "sdpa:flash_cpu"
        timings = stored["timings_ms"]
        assert set(timings) == {"queued", "preprocess", "inference", "first_token", "total"}
        assert timings["inference"] > 0
        # submitted -> admitted <= submitted -> first token <= submitted -> result
        assert timings["queued"] <= timings["first_token"] <= timings["total"]
        assert stored["finish_reason"] in ("stop", "length")
        success = worker.logged("MRC_SUCCESS", job_id=job_id)
        assert len(success) == 1
        assert float(success[0]["latency"]) > 0
        # the log's input is the result's billed prompt (review, helper-92: 305 against 307)
        assert int(success[0]["input_len"]) == stored["usage"]["prompt_tokens"] > 0
        # the default 64 new tokens at most (">= 0" could not fail: a count cannot be negative)
        assert 0 <= int(success[0]["output_len"]) <= 64
        assert success[0]["prompt_head"] == prompt[:64]
        status = json.loads(run_cli(env, "status", job_id).stdout)
        assert {k: status[k] for k in ("job_id", "state", "result_uri")} == {
            "job_id": job_id,
            "state": "succeeded",
            "result_uri": f"s3://{env['MRC_S3_BUCKET']}/results/{job_id}.json",
        }
        # and what a person wants next: attempts, times, and which worker ran it
        assert status["attempts"] == 1
        assert status["lane"] == "interactive"
        assert status["worker"] == worker.find("MRC_WORKER_READY")[0]["hostname"]
        assert status["submitted_at"] <= status["started_at"] <= status["updated_at"]
        assert json.loads(run_cli(env, "result", job_id).stdout) == stored


def test_submit_without_wait_prints_the_job_id_alone(env, worker: Worker, images_dir: Path) -> None:
    image = _write(images_dir, "a.png", imagegen.photo(300, 200, fmt="PNG"))
    done = run_cli(env, "submit", "--image", str(image), "--prompt", "what colour is the box?")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert len(done.stdout.splitlines()) == 1
    assert job_id
    waited = run_cli(env, "result", job_id)
    for _ in range(100):
        if waited.returncode == 0:
            break
        waited = run_cli(env, "result", job_id)
    assert json.loads(waited.stdout)["job_id"] == job_id


@pytest.mark.parametrize(
    ("name", "data", "code"),
    [
        ("not-an-image.jpg", b"this is plain text, not a JPEG\n", "unsupported_image_format"),
        ("truncated.jpg", imagegen.truncated_jpeg(), "image_decode_error"),
        ("empty.png", b"", "unsupported_image_format"),
        ("bomb.png", imagegen.png_header_only(60000, 60000), "image_too_large"),
    ],
)
def test_bad_image_fails_its_job_with_its_code(
    env, worker: Worker, images_dir: Path, name, data, code
) -> None:
    done = _submit_wait(env, _write(images_dir, name, data), "is this damaged?")
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "failed"
    assert result["text"] is None
    assert result["error"]["code"] == code
    assert result["error"]["retryable"] is False
    # the bytes were read and refused: the result names them (review: null for every failure)
    assert result["image"]["sha256"] == hashlib.sha256(data).hexdigest()
    errors = worker.logged("MRC_ERROR", job_id=result["job_id"])
    assert len(errors) == 1
    assert errors[0]["code"] == code


def test_awkward_prompt_is_logged_on_one_line_and_round_trips(env, worker: Worker, images_dir: Path) -> None:
    prompt = "refund? | a=b \\ back\nslash\r\n新行 😀 ||"
    done = _submit_wait(env, _write(images_dir, "ok.jpg", imagegen.photo(200, 150)), prompt)
    assert done.returncode == 0, done.stderr
    job_id = json.loads(done.stdout)["job_id"]
    worker.logged("MRC_SUCCESS", job_id=job_id)  # the line comes a moment after the result
    lines = [line for line in worker.log_path.read_text().splitlines() if f"job_id={job_id}" in line]
    assert len(lines) == 1
    assert lines[0].startswith("MRC_SUCCESS|")
    assert worker.find("MRC_SUCCESS", job_id=job_id)[0]["prompt_head"] == prompt


def test_cli_refuses_bad_submissions_and_enqueues_nothing(env, worker: Worker, images_dir: Path) -> None:
    image = _write(images_dir, "fine.jpg", imagegen.photo(100, 100))
    cases = [
        ("--image", str(images_dir / "missing.jpg"), "--prompt", "hello"),
        ("--image", str(image), "--prompt", "   "),
        ("--image", str(image), "--prompt", "hi", "--max-new-tokens", "0"),
        ("--image", str(image), "--prompt", "hi", "--max-new-tokens", "1000000"),
        ("--image", "https://example.com/cat.jpg", "--prompt", "hi"),
        ("--image", str(image), "--prompt", "hi", "--job-id", "bad id with spaces"),
    ]
    before = json.loads(run_cli(env, "queues", "--json").stdout)["lanes"]
    for args in cases:
        done = run_cli(env, "submit", *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stdout == ""
    assert json.loads(run_cli(env, "queues", "--json").stdout)["lanes"] == before


def test_same_job_id_twice_runs_once(env, worker: Worker, images_dir: Path) -> None:
    image = _write(images_dir, "dup.jpg", imagegen.photo(120, 90))
    job_id = f"dup-{uuid.uuid4().hex[:10]}"
    first = run_cli(env, "submit", "--image", str(image), "--prompt", "once", "--job-id", job_id)
    second = _submit_wait(env, image, "once", "--job-id", job_id)
    assert first.returncode == 0
    assert second.returncode == 0
    assert first.stdout.strip() == job_id == json.loads(second.stdout)["job_id"]
    assert len(worker.logged("MRC_SUCCESS", job_id=job_id)) == 1


def test_unknown_job_status(env, worker: Worker) -> None:
    status = json.loads(run_cli(env, "status", "never-submitted").stdout)
    assert status == {"job_id": "never-submitted", "state": "unknown", "result_uri": None}
    assert run_cli(env, "result", "never-submitted").returncode == 3  # no result yet, not "failed"


def test_queues_view_lists_the_live_worker(env, worker: Worker, images_dir: Path) -> None:
    # One job of our own, so the counts below are facts about it, not zeros a fresh session shows anyway
    image = _write(images_dir, "q.jpg", imagegen.photo(64, 48, seed=5))
    assert _submit_wait(env, image, "Counted?").returncode == 0
    hostname = worker.find("MRC_WORKER_READY")[0]["hostname"]

    def view_of_mine() -> tuple[dict, list[dict]]:
        view = json.loads(run_cli(env, "queues", "--json").stdout)
        return view, [w for w in view["workers"] if w["hostname"] == hostname]

    # the heartbeat carries the count every few seconds
    services.wait_for(lambda: view_of_mine()[1][0]["jobs"] >= 1, 30, "the worker's count of jobs")
    view, mine = view_of_mine()
    assert len(mine) == 1
    assert mine[0]["lanes"] == ["interactive", "backlog"]
    assert mine[0]["model"] == "tiny-fuyu-v1"
    assert mine[0]["quantization"] == "nf4"
    assert mine[0]["jobs"] >= 1
    assert set(view["lanes"]) == {"interactive", "backlog"}
    assert set(view["done_per_min"]) == {"interactive", "backlog"}  # from the completion events
    assert view["done_per_min"]["interactive"] > 0  # our job ended within the window
    assert view["backlog_limit"] == 10000
    ready = worker.find("MRC_ENGINE_READY")[0]
    assert mine[0]["engine_slots"] == int(ready["slots"])
    assert mine[0]["engine_slot_positions"] == int(ready["slot_positions"])
    text = run_cli(env, "queues").stdout
    assert f"worker {hostname}: lanes interactive,backlog" in text
    assert f"/{ready['slots']} running" in text
    assert f"cache of {ready['cache_positions']} positions, slots of {ready['slot_positions']}" in text


def test_health_endpoints(worker: Worker) -> None:
    base = f"http://127.0.0.1:{worker.http_port}"
    with urllib.request.urlopen(base + "/healthz") as r:
        assert r.status == 200
        health = json.loads(r.read())
    # The engine's held rows and a stalled backlog are shown (a starving backlog was invisible).
    assert {"engine_rows_held", "engine_backlog_stalled_steps"} <= set(health), health
    with urllib.request.urlopen(base + "/readyz") as r:
        ready = json.loads(r.read())
    assert ready["model"] == "tiny-fuyu-v1"
    assert ready["quantization"] == "nf4"
    assert ready["device"] == "cpu"
    assert ready["attention_backend"]
    # The cache: a pool of positions, what free memory holds at warm-up, at most MRC_BATCH_TOKEN_BUDGET;
    # each row holds its own need there, up to MRC_MODEL_BATCH_MAX_JOBS rows. The longest row holds the
    # largest image, the longest prompt and the most new tokens.
    assert ready["engine_slot_positions"] == 2340 + 2 + 512 + 512
    assert ready["engine_slots"] == 16
    assert ready["engine_cache_positions"] == 65536
    assert ready["engine_cache_bytes"] > 0
    assert "available RAM" in ready["engine_kv_measured_from"]
    assert ready["engine_decode"] == "rows"
    assert ready["attention_backend_decode"] == "sdpa:flash_cpu"  # rows attending to their own length
    with urllib.request.urlopen(base + "/metrics") as r:
        text = r.read().decode()
    assert "mrc_jobs_total" in text
    assert "mrc_worker_ready 1.0" in text
    # the lanes it consumes (the default, both), for the GPU-starved alert to weigh only their depth
    assert 'mrc_worker_lanes{lane="interactive"} 1.0' in text
    assert 'mrc_worker_lanes{lane="backlog"} 1.0' in text
    for series in (
        'mrc_queue_depth{lane="interactive"}',
        'mrc_queue_in_flight{lane="backlog"}',
        'mrc_queue_oldest_age_seconds{lane="interactive"}',
        "mrc_dead_letter_depth",
        "mrc_queue_metrics_up 1.0",
        "mrc_process_cpu_seconds_total",
        "mrc_process_resident_memory_bytes",
        "mrc_worker_buffered_jobs",
        "mrc_batch_in_progress",
        "mrc_model_batch_jobs_bucket",
        "mrc_model_batch_tokens_bucket",
        'mrc_job_stage_seconds_bucket{le="0.05",stage="queued"}',
        "mrc_engine_rows_running",
        'mrc_engine_rows_waiting{lane="backlog"}',
        "mrc_engine_rows_held",
        "mrc_engine_backlog_stalled_steps",
        'mrc_engine_admission_wait_seconds_bucket{lane="interactive",le="0.005"}',
        'mrc_engine_paused_rows_total{reason="ticket"}',
    ):
        assert series in text, series
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("mrc_engine_")
    }
    # jobs ran in earlier tests: the engine stepped, generated, and admits up to what /readyz says
    assert values["mrc_engine_steps_total"] > 0
    assert values["mrc_engine_generated_tokens_total"] >= values["mrc_engine_steps_total"]
    assert values["mrc_engine_kv_tokens_capacity"] == ready["engine_cache_positions"]
    assert 0 <= values["mrc_engine_kv_tokens_reserved"] <= ready["engine_cache_positions"]
    assert values["mrc_engine_slots"] == ready["engine_slots"]
    assert values["mrc_engine_positions_read_total"] > 0
    assert 0 < values["mrc_engine_prefill_calls_total"] <= values["mrc_engine_prefill_positions_total"]
    assert values["mrc_engine_positions_padding_total"] == 0  # rows read their own positions only
    assert 'prompt_tokens="0-50"' in text  # the latency heatmap's labels (jobs ran in earlier tests)
    assert "image_mp=" in text
    assert "mrc_gpu_" not in text  # no GPU here: the series are absent, not an error


def test_message_without_producer_is_checked_by_the_worker(env, worker: Worker) -> None:
    """Messages sent straight to the queue, bypassing the producer's checks, are checked by the worker."""
    from shared import names
    from shared.celery_app import make_celery
    from shared.settings import Settings

    settings = Settings(redis_url=env["MRC_REDIS_URL"])
    job_id = f"raw-{uuid.uuid4().hex[:10]}"
    body = {
        "schema": "mrc.job/1",
        "job_id": job_id,
        "image_uri": "s3://elsewhere/x.jpg",
        "prompt": " ",
        "max_new_tokens": 4,
    }
    make_celery(settings).send_task(
        names.TASK_NAME, kwargs={"job": body}, task_id=job_id, queue=names.queue_name("interactive")
    )
    forbidden_id = f"raw-{uuid.uuid4().hex[:10]}"
    body = {**body, "job_id": forbidden_id, "prompt": "fine"}
    make_celery(settings).send_task(
        names.TASK_NAME, kwargs={"job": body}, task_id=forbidden_id, queue=names.queue_name("interactive")
    )
    codes = {}
    for _ in range(300):
        codes = {
            e["job_id"]: e["code"] for e in worker.find("MRC_ERROR") if e["job_id"] in (job_id, forbidden_id)
        }
        if len(codes) == 2:
            break
        services.time.sleep(0.1)
    assert codes == {job_id: "invalid_job", forbidden_id: "image_source_forbidden"}


def test_control_token_text_sent_past_the_producer_is_defused_by_the_worker(
    env, worker: Worker, images_dir: Path
) -> None:
    """A message straight to the queue (no producer to neutralise it) whose prompt holds every Fuyu
    control text, beside ordinary jobs in the engine: all succeed."""
    from shared import names
    from shared.celery_app import make_celery
    from shared.prompts import FUYU_CONTROL_TEXT
    from shared.settings import Settings

    image = _write(images_dir, "ctl.jpg", imagegen.photo(120, 90))
    uri = json.loads(_submit_wait(env, image, "warm the image").stdout)["image"]["uri"]
    app = make_celery(Settings(redis_url=env["MRC_REDIS_URL"]))
    failed_before = len(worker.find("MRC_ENGINE_STEP_FAILED"))
    ids = []
    for i, prompt in enumerate(["is it broken?", " ".join(FUYU_CONTROL_TEXT) + " refund?", "|SPEAKER|"]):
        job_id = f"ctl-{uuid.uuid4().hex[:8]}-{i}"
        body = {"job_id": job_id, "image_uri": uri, "prompt": prompt, "max_new_tokens": 4}
        app.send_task(names.TASK_NAME, kwargs={"job": body}, task_id=job_id, queue="mrc.interactive")
        ids.append(job_id)
    for job_id in ids:
        services.wait_for(lambda j=job_id: run_cli(env, "result", j).returncode != 3, 60, job_id)
        result = json.loads(run_cli(env, "result", job_id).stdout)
        assert result["status"] == "succeeded", result
    assert len(worker.find("MRC_ENGINE_STEP_FAILED")) == failed_before, "no engine step failed"


def test_repeated_question_about_the_same_photo_is_answered_from_the_cache(
    env, worker: Worker, images_dir: Path
) -> None:
    image = _write(images_dir, "cached.jpg", imagegen.photo(300, 220, seed=42))
    prompt = f"这个包裹坏了，我可以退款吗？ {uuid.uuid4().hex}"  # unique: not cached by an earlier run
    first = json.loads(_submit_wait(env, image, prompt).stdout)
    second = json.loads(_submit_wait(env, image, prompt).stdout)
    third = json.loads(_submit_wait(env, image, prompt + "？").stdout)
    assert (first["cache_hit"], second["cache_hit"], third["cache_hit"]) == (False, True, False)
    assert second["text"] == first["text"]
    assert second["job_id"] != first["job_id"]
    hit_line = worker.logged("MRC_SUCCESS", job_id=second["job_id"])
    assert len(hit_line) == 1
    assert hit_line[0]["cache_hit"] == "true"
    view = json.loads(run_cli(env, "queues", "--json").stdout)
    assert view["cache"]["hits"] >= 1
    assert 0 < view["cache"]["hit_rate"] < 1


def _kept_fetches(worker: Worker) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.http_port}/metrics") as r:
        text = r.read().decode()
    line = next(x for x in text.splitlines() if x.startswith('mrc_image_fetches_total{result="kept"}'))
    return float(line.split()[-1])


def test_a_follow_up_about_a_kept_photo_is_answered_without_fetching_it(
    env, worker: Worker, images_dir: Path
) -> None:
    """`mrc submit` uploads a photo under its content's name; the worker keeps it decoded after the first
    question, so a second job naming that upload is answered without an S3 GET (counted `kept`), with
    the same image facts: the object is deleted before it, and a GET would have failed it with
    image_not_found."""
    image = _write(images_dir, "follow.jpg", imagegen.photo(310, 230, seed=77))
    first = json.loads(_submit_wait(env, image, f"Is it damaged? {uuid.uuid4().hex}").stdout)
    kept = _kept_fetches(worker)
    bucket, key = first["image"]["uri"][5:].split("/", 1)
    assert key.endswith(f"{first['image']['sha256']}.jpg")
    _s3(env).delete_object(Bucket=bucket, Key=key)
    second = json.loads(_submit_wait(env, first["image"]["uri"], f"What colour? {uuid.uuid4().hex}").stdout)
    assert (first["status"], second["status"]) == ("succeeded", "succeeded"), second
    assert _kept_fetches(worker) == kept + 1
    assert second["image"] == first["image"]
