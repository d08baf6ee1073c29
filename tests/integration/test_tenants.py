"""Keys are tenants (issue 36, items 1-3): through mrc-api's public routes, with keys alice and bob on
both lanes, carol on the backlog lane only and ops with the `all-tenants` scope, against the session's
Redis, S3 and worker. Each test failed before keys were tenants: bob read alice's answers and events,
named her uploads, and took her job ids."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from producer.client import Client
from producer.ops import queues
from producer.server import create_app
from scripts import devservices as services
from shared import names, scrape, tenants
from shared.lane_metrics import LaneCollector
from shared.records import connect
from tests.support import imagegen

pytestmark = pytest.mark.integration

KEYS = {"alice": "k-alice", "bob": "k-bob", "carol": "k-carol", "ops": "k-ops", "reader": "k-reader"}
SCOPES = {"alice": "", "bob": "", "carol": "@backlog", "ops": "@interactive+backlog+all-tenants",
          "reader": "@all-tenants"}  # fmt: skip
OWNER = {name: hashlib.sha256(key.encode()).hexdigest()[:12] for name, key in KEYS.items()}
AS = {name: {"Authorization": f"Bearer {key}"} for name, key in KEYS.items()}


@pytest.fixture(scope="module")
def api(env: dict[str, str], worker: services.Worker) -> Iterator[TestClient]:
    spec = ",".join(hashlib.sha256(KEYS[n].encode()).hexdigest() + SCOPES[n] for n in KEYS)
    settings = services.settings_from_env({**env, "MRC_API_KEYS": spec, "MRC_API_RATE_PER_S": "0"})
    with pytest.MonkeyPatch.context() as patch:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
            patch.setenv(name, env[name])
        with TestClient(create_app(settings)) as client:
            yield client


def _id(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def _submit(api: TestClient, who: str, job_id: str, prompt: str, seed: int, lane: str = "interactive") -> Any:
    return api.post(
        "/v1/jobs",
        data={"prompt": prompt, "job_id": job_id, "max_new_tokens": "3", "lane": lane},
        files={"image": ("p.jpg", imagegen.photo(96, 64, seed=seed), "image/jpeg")},
        headers=AS[who],
    )


def _result(api: TestClient, who: str, job_id: str) -> dict[str, Any]:
    for _ in range(8):  # each wait is bounded by the server; a slow machine may need several
        reply = api.get(f"/v1/jobs/{job_id}/result", params={"wait": 20}, headers=AS[who])
        if reply.status_code == 200:
            return dict(reply.json())
        assert reply.status_code == 202, reply.text
    raise AssertionError(f"no result for {job_id}")


def test_a_key_reads_only_its_own_jobs_results_and_events(
    api: TestClient, client: Client, env: dict[str, str]
) -> None:
    job_id = _id("order")
    fence = {who: api.get("/v1/events", params={"after": "0"}, headers=AS[who]).json()["last_id"]
             for who in ("alice", "bob", "reader")}  # fmt: skip
    assert _submit(api, "alice", job_id, "What colour is the parcel?", seed=1).status_code == 202
    mine = _result(api, "alice", job_id)
    assert mine["job_id"] == job_id  # as she named it
    for who in ("bob", "carol"):
        for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/result"):
            reply = api.get(path, params={"wait": 1}, headers=AS[who])
            assert reply.status_code == 404, (who, path, reply.text)
            assert mine["image"]["uri"] not in reply.text
            assert "colour" not in reply.text
        # Her stored id, spelt out, is no id in another key's namespace either.
        stored = tenants.job_id(OWNER["alice"], job_id)
        assert api.get(f"/v1/jobs/{stored}/result", headers=AS[who]).status_code == 404
    # Events: hers in her stream, named as she names the job; none of hers in bob's.
    seen = _events(api, "alice", fence["alice"], job_id)
    assert [e["job_id"] for e in seen if e["job_id"] == job_id] == [job_id]
    bobs = api.get("/v1/events", params={"after": fence["bob"]}, headers=AS["bob"]).json()["events"]
    assert all(job_id not in json.dumps(e) for e in bobs)
    # The all-tenants scope (ops tools) reads any job by its stored id, and follows the fleet's events
    # (a read-only key, with no lane, too).
    stored = tenants.job_id(OWNER["alice"], job_id)
    assert stored in {e["job_id"] for e in _events(api, "reader", fence["reader"], stored)}
    assert api.get(f"/v1/jobs/{stored}", headers=AS["reader"]).status_code == 200
    ops = api.get(f"/v1/jobs/{tenants.job_id(OWNER['alice'], job_id)}/result", headers=AS["ops"])
    assert ops.status_code == 200
    assert ops.json()["job_id"] == tenants.job_id(OWNER["alice"], job_id)
    # So do the operator's commands (no key), with the id `mrc events` and the ops page show (review,
    # helper-62: both refused it as a usage error).
    status = services.run_cli(env, "status", stored)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["state"] == "succeeded"
    result = services.run_cli(env, "result", stored)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ops.json()
    for bad in (f"{OWNER['alice']}~", f"{OWNER['alice'][:11]}~{job_id}", f"../{stored}"):
        assert services.run_cli(env, "status", bad).returncode == 2, bad


def _events(api: TestClient, who: str, after: str, job_id: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for _ in range(10):
        page = api.get("/v1/events", params={"after": after, "wait": 3}, headers=AS[who]).json()
        found += page["events"]
        after = page["last_id"]
        if any(e["job_id"] == job_id for e in found):
            break
    return found


def test_a_batch_job_of_one_key_is_no_job_of_another(api: TestClient, client: Client) -> None:
    """carol (backlog lane only) read an answer from alice's batch by its job id."""
    batch_job = f"batch_{uuid.uuid4().hex[:24]}.a2"
    client.records.claim(tenants.job_id(OWNER["alice"], batch_job), "backlog")  # queued in her namespace
    assert api.get(f"/v1/jobs/{batch_job}", headers=AS["alice"]).status_code == 200
    assert api.get(f"/v1/jobs/{batch_job}/result", headers=AS["carol"]).status_code == 404
    assert api.get(f"/v1/jobs/{batch_job}", headers=AS["carol"]).status_code == 404


def test_client_ids_are_per_key_and_a_replay_is_the_callers_own_job(api: TestClient, client: Client) -> None:
    job_id = _id("order-42")
    assert _submit(api, "alice", job_id, "What colour is the parcel?", seed=2).status_code == 202
    # bob's own order-42 (another photo, another question) is his job, not a 409 ...
    assert _submit(api, "bob", job_id, "Is the parcel damaged?", seed=3).status_code == 202
    # ... and bob sending alice's exact request under her id makes nothing of hers his: the same id
    # names his own job (200: the same job again), counted to him.
    assert _submit(api, "bob", job_id, "Is the parcel damaged?", seed=3).status_code == 200
    hers, his = _result(api, "alice", job_id), _result(api, "bob", job_id)
    assert hers["prompt"]["chars"] != his["prompt"]["chars"]
    assert hers["image"]["uri"] != his["image"]["uri"]
    records = {who: client.records.get(tenants.job_id(OWNER[who], job_id)) for who in ("alice", "bob")}
    assert records["alice"]["fingerprint"] != records["bob"]["fingerprint"]
    # Each result object lives under its stored id.
    for who, result in (("alice", hers), ("bob", his)):
        stored = client.result(tenants.job_id(OWNER[who], job_id))
        assert stored is not None
        assert stored["text"] == result["text"]
    assert client.result(job_id) is None  # nothing under the bare id


def test_a_key_names_only_its_own_uploads_and_a_refusal_tells_nothing(api: TestClient) -> None:
    job_id = _id("photo")
    assert _submit(api, "alice", job_id, "What colour is the parcel?", seed=4).status_code == 202
    leaked = _result(api, "alice", job_id)["image"]["uri"]
    assert f"/inputs/{OWNER['alice']}/" in leaked
    missing = leaked.rsplit("/", 1)[0] + "/" + "0" * 64 + ".jpg"  # her folder, no such object
    answers = []
    for uri in (leaked, missing):
        reply = api.post("/v1/jobs", json={"image": uri, "prompt": "Refund?"}, headers=AS["bob"])
        assert reply.status_code == 422, reply.text
        answers.append(reply.json()["error"]["message"].replace(uri, "URI"))
        content = [{"type": "text", "text": "Refund?"}, {"type": "image_url", "image_url": {"url": uri}}]
        request = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
        chat = api.post("/v1/chat/completions", json=request, headers=AS["bob"])
        assert chat.status_code == 400, chat.text
        assert chat.json()["error"]["code"] == "image_source_forbidden"
        answers.append(chat.json()["error"]["message"].replace(uri, "URI"))
    assert answers[0] == answers[2]
    assert answers[1] == answers[3]
    # Her own upload she may name again (a follow-up question about the photo she sent).
    again = api.post("/v1/jobs", json={"image": leaked, "prompt": "Is it damaged?"}, headers=AS["alice"])
    assert again.status_code == 202, again.text


def test_sources_an_operator_allowed_for_one_key_are_that_keys_only(
    env: dict[str, str], client: Client, tmp_path: Any
) -> None:
    photo = tmp_path / "catalogue.jpg"
    photo.write_bytes(imagegen.photo(64, 48, seed=5))
    uri = client.upload_image(photo)[0]  # the shared inputs/ folder, no key's
    alice = hashlib.sha256(KEYS["alice"].encode()).hexdigest()
    spec = ",".join(hashlib.sha256(KEYS[n].encode()).hexdigest() + SCOPES[n] for n in KEYS)
    allowed = f"{alice}=s3://{env['MRC_S3_BUCKET']}/inputs/"
    settings = services.settings_from_env({**env, "MRC_API_KEYS": spec, "MRC_API_KEY_SOURCES": allowed})
    with TestClient(create_app(settings)) as api:
        body = {"image": uri, "prompt": "What colour is the parcel?"}
        assert api.post("/v1/jobs", json=body, headers=AS["alice"]).status_code == 202
        assert api.post("/v1/jobs", json=body, headers=AS["bob"]).status_code == 422
        # A source as wide as the uploads folder still never reaches another key's own uploads.
        bobs = f"s3://{env['MRC_S3_BUCKET']}/{names.uploads_folder('', OWNER['bob'])}{'1' * 64}.jpg"
        assert api.post("/v1/jobs", json={**body, "image": bobs}, headers=AS["alice"]).status_code == 422


def test_one_keys_backlog_leaves_every_other_key_its_share_of_the_lane(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Left out since helper-97: one key's batch kept the backlog lane at MRC_BACKLOG_MAX_DEPTH, and every
    other key's backlog submission met 503 `queue_full` until it drained. While several keys (the
    command line counts as one) have backlog jobs held (queued or running), each may hold the limit
    divided by their number, and one under its share is let in even while the lane is full of another's
    jobs; once the jobs end, a key alone may fill the lane again."""
    idle = {
        **env,
        "MRC_REDIS_URL": env["MRC_REDIS_URL"].rsplit("/", 1)[0] + "/12",
        "MRC_BACKLOG_MAX_DEPTH": "6",
    }
    spec = ",".join(hashlib.sha256(KEYS[n].encode()).hexdigest() + SCOPES[n] for n in ("alice", "bob"))
    settings = services.settings_from_env({**idle, "MRC_API_KEYS": spec, "MRC_API_RATE_PER_S": "0"})
    redis_db = connect(settings)
    redis_db.flushdb()
    photo = tmp_path / "parcel.jpg"
    photo.write_bytes(imagegen.photo(64, 48, seed=5))
    manifest = tmp_path / "night.jsonl"
    lines = [{"custom_id": f"n{i}", "image": str(photo), "prompt": "Torn?"} for i in range(5)]
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))

    def backlog(api: TestClient, who: str, count: int) -> list[Any]:
        return [_submit(api, who, _id(who), "Refund?", seed=i, lane="backlog") for i in range(count)]

    with pytest.MonkeyPatch.context() as patch:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
            patch.setenv(name, env[name])
        with TestClient(create_app(settings)) as api:
            assert _submit(api, "alice", "first-of-six", "Refund?", seed=0, lane="backlog").status_code == 202
            assert [r.status_code for r in backlog(api, "alice", 6)] == [202] * 5 + [503]  # alone: the limit
            again = _submit(api, "alice", "first-of-six", "Refund?", seed=0, lane="backlog")
            assert again.status_code == 200, again.text  # the same job again is answered (review: 503)
            bob = backlog(api, "bob", 4)
            assert [r.status_code for r in bob] == [202, 202, 202, 503]  # the lane full of hers: his 6 / 2
            assert bob[-1].json()["error"]["code"] == "queue_full"
            assert "its share is 3" in bob[-1].json()["error"]["message"], bob[-1].text
            assert [r.status_code for r in backlog(api, "alice", 1)] == [503]  # she holds 6, past her 3
            run = services.run_cli(idle, "backlog", str(manifest), "--no-block")
            assert run.returncode == 4, run.stderr  # the command line is a third key: 6 / 3 = 2 of its 5
            assert "its share is 2" in run.stderr, run.stderr
            # Review, helper-104: a run waiting for its share said "(at its depth limit)" every --interval
            with pytest.raises(subprocess.TimeoutExpired) as waiting:  # it waits for room: stopped here
                services.run_cli(
                    idle, "backlog", str(manifest), "--run-id", "waits", "--interval", "0.5", timeout=5
                )
            said = str(waiting.value.stderr)
            assert "waiting for room on the backlog lane (the lane is shared by the 3 keys" in said, said
            assert "its share is 2" in said
            assert Client(settings).lane_depth("backlog") == 11
            # bob's and the command line's first jobs beside hers are on the ahead list: taken first
            ahead, main = names.queue_keys("backlog")[names.AHEAD_STEP // 3], names.queue_keys("backlog")[0]
            assert (redis_db.llen(ahead), redis_db.llen(main)) == (5, 6)
            lanes = LaneCollector(redis_db, runs=True)

            def held_series() -> dict[str, float]:
                time.sleep(scrape.CACHE_S)  # past the exporter's cache of a scrape
                return {
                    sample.labels["key"]: sample.value
                    for family in lanes.collect()
                    if family.name == "mrc_backlog_held_jobs"
                    for sample in family.samples
                }

            held = held_series()
            assert held == {OWNER["alice"]: 6, OWNER["bob"]: 3, "-": 2}
            view = queues.collect(redis_db, settings)  # `mrc queues --json`
            assert (view["backlog_held_by_key"], view["backlog_share_each"]) == (held, 2)
            worker = services.start_worker({**idle, "MRC_MODEL": "echo"}, tmp_path / "worker.log")
            try:
                deadline = time.monotonic() + 120
                while redis_db.hlen(names.backlog_held_counts_key()) or Client(settings).lane_depth(
                    "backlog"
                ):
                    assert time.monotonic() < deadline, redis_db.hgetall(names.backlog_held_counts_key())
                    time.sleep(0.2)
            finally:
                worker.stop()
            assert redis_db.zcard(names.backlog_held_key()) == 0  # every end let go of its hold
            assert held_series() == dict.fromkeys(held, 0)  # a key's series stays at 0 (review, helper-103)
            # A hold that never saw its end (its record purged by hand) stops counting after 24 h: a
            # lost count opens the lane, it never halves a key's share for good.
            redis_db.zadd(names.backlog_held_key(), {"0123456789ab lost-job": time.time() - 25 * 3600})
            redis_db.hincrby(names.backlog_held_counts_key(), "0123456789ab", 1)
            assert [r.status_code for r in backlog(api, "bob", 7)] == [202] * 6 + [503]  # alone again
            assert redis_db.hgetall(names.backlog_held_counts_key()) == {OWNER["bob"]: "6"}
        off = services.settings_from_env(
            {**idle, "MRC_API_KEYS": spec, "MRC_API_RATE_PER_S": "0", "MRC_BACKLOG_KEY_SHARES": "false"}
        )
        with TestClient(create_app(off)) as api:  # shares off: one depth, first come first in
            (refused,) = backlog(api, "alice", 1)
            assert refused.status_code == 503
            assert "share" not in refused.json()["error"]["message"]
    redis_db.flushdb()
