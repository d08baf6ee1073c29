"""The ops page (`GET /ops`) in a real browser: Debian's headless Chromium driven by Selenium through
Debian's chromedriver (Selenium speaks the WebDriver protocol to the system's own browser, so nothing
is downloaded at test time; Playwright would bring a browser build of its own). Real Redis, S3, the
session's worker and mrc-api over HTTP: tickets, a backlog run and a job that dead-letters, then what a
person sees, and what a key without the `ops` scope, or anyone, must never see there."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from producer.client import Client
from scripts import devservices as services
from shared.errors import OutOfMemory
from shared.records import RedisJobRecords, connect
from shared.settings import Settings
from shared.stores.memory import MemoryStore
from tests.support import imagegen
from tests.support.api_server import api_env, serve
from workers.backends.echo import EchoBackend
from workers.pipeline import assemble
from workers.slots import Message

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("chromedriver") is None, reason="make install puts chromium-driver in"),
]

OPS, TENANT = "k-ops-viewer", "k-ops-tenant"
SECRET = f"zebra-{uuid.uuid4().hex[:10]}"  # in every prompt here: never on the page


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def ops_env(env: dict[str, str]) -> Iterator[dict[str, str]]:
    keys = f"{_digest(OPS)}@ops,{_digest(TENANT)}@interactive+backlog"
    with api_env(env, MRC_API_KEYS=keys, MRC_API_RATE_PER_S="0", MRC_OPS_REFRESH_S="0.5") as ready:
        yield ready


@pytest.fixture(scope="module")
def api(ops_env: dict[str, str], worker: services.Worker) -> Iterator[str]:
    with serve(ops_env) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1800",
    ):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    # Chromium's own scratch files go to the test's folder, removed with it, not to /tmp.
    scratch = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("chromium"))}
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver"), env=scratch), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _dead_letter_one(ops_env: dict[str, str]) -> str:
    """A job that runs out of attempts (the model out of memory, its one attempt) through the worker's
    own finishing code, on the session's Redis: its dead letter lands in the real list."""
    settings = services.settings_from_env({**ops_env, "MRC_MAX_ATTEMPTS": "1"})
    store = MemoryStore()
    store.put_bytes("inputs/one.jpg", imagegen.photo(32, 32, seed=5), "image/jpeg")
    records = RedisJobRecords(connect(settings))
    backend = EchoBackend(fail_on="HUGE", error=OutOfMemory("CUDA out of memory (the ops page's test)"))
    pipeline = assemble(backend, store, store, records, Settings(max_attempts=1))
    job_id = f"ops-dlq-{uuid.uuid4().hex[:8]}"
    body = {
        "job_id": job_id,
        "image_uri": "s3://mrc/inputs/one.jpg",
        "prompt": f"HUGE {SECRET}",
        "max_new_tokens": 4,
    }
    assert pipeline.run([Message(job_id, body)]) == ["failed"]
    pipeline.close()
    return job_id


def _sign_in(browser: Any, api: str, key: str) -> None:
    """Sign in through the form, and wait until the page it leads to has replaced the form: a read
    right after the click could meet the form still there (a fresh-clone run read '' for the 403).
    While the page changes, chromedriver may answer a look at the old button with an error of its own
    ("unhandled inspector error: ... Node with given id does not belong to the document": a CI run
    failed on it) before it says the button is stale: the wait asks again."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{api}/ops")
    browser.find_element(By.ID, "ops-key").send_keys(key)
    button = browser.find_element(By.ID, "ops-login")
    button.click()
    wait = WebDriverWait(browser, 30, ignored_exceptions=(WebDriverException,))
    wait.until(expected_conditions.staleness_of(button))


def _live(browser: Any, css: str, cell: int | None = None) -> str:
    """The text of the first element `css` finds (of its `cell`-th cell), '' when there is none. The
    page replaces its main part at every refresh: an element found a moment ago may be gone, so every
    read finds it again, and a read that meets a replaced element is tried again (stale, gone, or
    chromedriver's own error for a node no longer in the document: see _sign_in)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    for _attempt in range(20):
        try:
            found = browser.find_elements(By.CSS_SELECTOR, css)
            if not found:
                return ""
            if cell is None:
                return str(found[0].text)
            return str(found[0].find_elements(By.TAG_NAME, "td")[cell].text)
        except (WebDriverException, IndexError):
            time.sleep(0.05)
    return ""


def _text(browser: Any, element_id: str) -> str:
    return _live(browser, f"#{element_id}")


def _wait(what: str, check: Any, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"the page never showed {what}"
        time.sleep(0.3)


def test_an_operator_sees_lanes_workers_the_run_moving_dead_letters_and_errors(
    api: str, ops_env: dict[str, str], browser: Any, tmp_path: Path, worker: services.Worker
) -> None:

    _sign_in(browser, api, OPS)
    assert "mrc ops" in browser.title
    assert _live(browser, 'tr[data-lane="interactive"]').startswith("interactive")
    assert _live(browser, 'tr[data-lane="backlog"]').startswith("backlog")
    hostname = worker.find("MRC_WORKER_READY")[0]["hostname"]
    _wait("the worker, ready", lambda: "ready" in _live(browser, f'tr[data-worker="{hostname}"]'))
    # A backlog run, watched as it goes (the page refreshes itself twice a second here).
    photo = tmp_path / "parcel.jpg"
    photo.write_bytes(imagegen.photo(96, 64, seed=7))
    manifest = tmp_path / "run.jsonl"
    lines = [
        {"custom_id": f"r{i}", "image": str(photo), "prompt": f"{SECRET} line {i}", "max_new_tokens": 16}
        for i in range(40)
    ]
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_id = f"ops-{uuid.uuid4().hex[:6]}"
    seen: list[str] = []

    def progress() -> bool:
        now = _live(browser, f'tr[data-run="{run_id}"] .progress')
        if now and (not seen or seen[-1] != now):
            seen.append(now)
        return bool(seen) and seen[-1] == "40/40"

    def shown() -> bool:
        progress()
        return bool(seen)

    # Watched from the moment it is sent: the page shows the run from its first line on. The worker is
    # held (SIGSTOP) until the page has shown the run unfinished: a fast machine ran all 40 jobs within
    # one refresh, and the page's first sight of the run was its end (CI: "the bar never moved").
    with worker.held():
        sending = services.start_cli(ops_env, "backlog", str(manifest), "--run-id", run_id)
        try:
            _wait("the run, before the worker takes it", shown)
        except BaseException:
            sending.kill()
            raise
    try:
        _wait("the run's progress reach 40/40", progress, timeout=180)
    finally:
        assert sending.wait(60) == 0
    assert len(seen) >= 2, f"the bar never moved: {seen}"  # seen before its end, then at it
    # A ticket through the API, and a job that dead-letters.
    with httpx.Client(timeout=60) as http:
        files = {"image": ("p.jpg", imagegen.photo(64, 64, seed=8), "image/jpeg")}
        sent = http.post(
            f"{api}/v1/jobs", headers={"Authorization": f"Bearer {TENANT}"}, files=files,
            data={"prompt": f"{SECRET} ticket", "max_new_tokens": "4"},
        )  # fmt: skip
        assert sent.status_code in (200, 202), sent.text
    dead = _dead_letter_one(ops_env)
    _wait("the dead letter", lambda: int(_text(browser, "ops-dlq-count") or 0) >= 1)
    assert _text(browser, "ops-dlq-command") == "mrc dlq requeue"
    assert dead in _text(browser, "ops-dlq-entries")
    oom = _wait("the out_of_memory count", lambda: _live(browser, 'tr[data-code="out_of_memory"]', 1))
    assert int(oom) >= 1
    assert "mrc dlq requeue" in _text(browser, "ops-problems")
    _wait("the tenant's usage", lambda: _live(browser, f'tr[data-key="{_digest(TENANT)[:12]}"]', 1))
    shot = tmp_path / "ops.png"
    assert browser.save_screenshot(str(shot))
    if os.environ.get("OPS_PAGE_SCREENSHOT"):  # docs/ops.png: `OPS_PAGE_SCREENSHOT=docs/ops.png pytest ...`
        shutil.copy(shot, os.environ["OPS_PAGE_SCREENSHOT"])
    assert shot.stat().st_size > 10_000


def test_without_the_ops_scope_the_page_is_403_and_no_prompt_or_answer_is_ever_shown(
    api: str, ops_env: dict[str, str], browser: Any, client: Client
) -> None:
    with httpx.Client(timeout=120) as http:
        files = {"image": ("p.jpg", imagegen.photo(64, 64, seed=9), "image/jpeg")}
        tenant = {"Authorization": f"Bearer {TENANT}"}
        sent = http.post(
            f"{api}/v1/jobs", headers=tenant, files=files,
            data={"prompt": f"{SECRET} question", "max_new_tokens": "12"},
        )  # fmt: skip
        assert sent.status_code in (200, 202), sent.text
        job_id = sent.json()["job_id"]
        result = http.get(f"{api}/v1/jobs/{job_id}/result?wait=30", headers=tenant)
        assert result.status_code == 200, result.text
        answer = str(result.json()["text"])
        assert http.get(f"{api}/ops/state", headers={"Authorization": f"Bearer {TENANT}"}).status_code == 403
        assert http.get(f"{api}/ops/state").status_code == 401
        state = http.get(f"{api}/ops/state", headers={"Authorization": f"Bearer {OPS}"})
        assert state.status_code == 200
        assert http.get(f"{api}/v1/jobs/x", headers={"Authorization": f"Bearer {OPS}"}).status_code in (
            403,
            404,
        )
        page = http.get(f"{api}/ops", headers={"Authorization": f"Bearer {OPS}"}).text
    for text in (state.text, page):
        assert SECRET not in text
        assert answer not in text or len(answer) < 8  # a word or two might occur on any page
    browser.delete_all_cookies()
    _sign_in(browser, api, TENANT)
    assert "403" in _text(browser, "ops-forbidden")
    assert SECRET not in browser.page_source
