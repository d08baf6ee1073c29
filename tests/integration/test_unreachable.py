"""Redis or S3 out of reach, and settings that cannot work: one clear line and the contract's exit
code, within a few seconds, never a traceback and never a job reported as failed."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from producer.server import create_app
from scripts import devservices as services
from tests.support import imagegen

pytestmark = pytest.mark.integration


def _dead_url(scheme: str) -> str:
    return f"{scheme}://127.0.0.1:{services.free_port()}"  # nothing listens there


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if not line.startswith("MRC_UNKNOWN_SETTING")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [
        ("submit", "--image", "s3://{bucket}/inputs/x.jpg", "--prompt", "refund?"),
        ("status", "some-job"),
        ("result", "some-job"),  # review: "no result for some-job yet", exit 3
        ("queues", "--json"),
        ("dlq", "list"),
    ],
)
def test_redis_unreachable_is_exit_5_naming_redis(env: dict[str, str], args: tuple[str, ...]) -> None:
    began = time.monotonic()
    args = tuple(arg.format(bucket=env["MRC_S3_BUCKET"]) for arg in args)
    done = services.run_cli({**env, "MRC_REDIS_URL": _dead_url("redis") + "/0"}, *args, timeout=30)
    assert done.returncode == 5, done.stderr
    assert "Redis" in _one_line(done.stderr)
    assert done.stdout == ""
    assert time.monotonic() - began < 15


@pytest.mark.parametrize(
    "args",
    [("submit", "--image", "s3://{bucket}/inputs/x.jpg", "--prompt", "refund?"), ("result", "some-job")],
)
def test_s3_unreachable_is_exit_5_naming_s3(
    env: dict[str, str], redis_service: services.Service, args: tuple[str, ...]
) -> None:
    began = time.monotonic()
    args = tuple(arg.format(bucket=env["MRC_S3_BUCKET"]) for arg in args)
    done = services.run_cli({**env, "MRC_S3_ENDPOINT_URL": _dead_url("http")}, *args, timeout=30)
    assert done.returncode == 5, done.stderr
    assert "S3" in _one_line(done.stderr)
    assert time.monotonic() - began < 15


def test_an_s3_that_hangs_is_exit_5_naming_s3_for_a_command_and_a_starting_worker(
    env: dict[str, str], tmp_path: Path
) -> None:
    """An endpoint that takes connections and never answers (review, helper-74: 30 s, the stores'
    read timeout, before `mrc submit` or a starting worker said so; MRC_CONNECT_TIMEOUT_S bounds it)."""
    with socket.create_server(("127.0.0.1", 0)) as hung:  # listens: the kernel takes the connections
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        hanging = {**env, "MRC_S3_ENDPOINT_URL": url, "MRC_CONNECT_TIMEOUT_S": "1", "MRC_MODEL": "echo"}
        image = tmp_path / "h.jpg"
        image.write_bytes(imagegen.photo(32, 24))
        done = services.run_cli(hanging, "submit", "--image", str(image), "--prompt", "refund?", timeout=20)
        assert done.returncode == 5, done.stderr
        assert "S3" in _one_line(done.stderr)
        started = subprocess.run(
            [str(services.BIN / "mrc-worker")],
            env=hanging,
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        assert started.returncode == 5, started.stderr
        assert "cannot reach S3" in started.stderr


def _worker(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(services.BIN / "mrc-worker")], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_worker_start_with_redis_unreachable_is_exit_5(env: dict[str, str]) -> None:
    done = _worker({**env, "MRC_REDIS_URL": _dead_url("redis")})
    assert done.returncode == 5
    assert "Redis" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MRC_MODEL_BATCH_MAX_JOBS", "0"),
        ("MRC_MAX_ATTEMPTS", "0"),
        ("MRC_FETCH_THREADS", "-2"),
        ("MRC_LOG_LEVEL", "CHATTY"),
        ("MRC_METRICS_PORT", "70000"),
        ("MRC_REDIS_URL", "redis://127.0.0.1:notaport/0"),
        ("MRC_REDIS_URL", "http://127.0.0.1:6379"),
        ("MRC_ALLOWED_BUCKETS", "abc"),  # not JSON: a traceback from both (review)
    ],
)
def test_bad_settings_are_one_line_naming_the_variable(env: dict[str, str], name: str, value: str) -> None:
    for done in (_worker({**env, name: value}), services.run_cli({**env, name: value}, "queues")):
        assert done.returncode == 2, done.stderr
        line = _one_line(done.stderr)
        assert name in line
        assert "bad settings" in line


def test_a_misspelt_setting_is_warned_about(env: dict[str, str]) -> None:
    done = services.run_cli({**env, "MRC_BATCH_MAX_JOB": "4"}, "queues", "--json")
    assert done.returncode == 0
    warned = [line for line in done.stderr.splitlines() if line.startswith("MRC_UNKNOWN_SETTING")]
    assert len(warned) == 1
    assert "MRC_BATCH_MAX_JOB" in warned[0]


@pytest.mark.parametrize("command", ["status", "result"])
@pytest.mark.parametrize("job_id", ["../inputs/x", "a/b", "-", "x" * 129, "id\u00e9"])
def test_a_job_id_no_submit_could_make_is_exit_2_before_any_service(
    env: dict[str, str], command: str, job_id: str
) -> None:
    dead = {"MRC_REDIS_URL": _dead_url("redis") + "/0", "MRC_S3_ENDPOINT_URL": _dead_url("http")}
    done = services.run_cli({**env, **dead}, command, "--", job_id, timeout=30)
    assert done.returncode == 2, done.stderr
    assert "job_id" in _one_line(done.stderr)
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [("--deadline", "garbage", "deadline"), ("--ticket-id", "t" * 300, "ticket_id")],
)
def test_a_field_the_job_itself_refuses_is_exit_2_before_any_service(
    env: dict[str, str], tmp_path: Path, option: str, value: str, named: str
) -> None:
    """Review, helper-87: with Redis away these were exit 5 ("cannot reach Redis"), with it up 2."""
    image = tmp_path / "p.png"
    image.write_bytes(imagegen.photo(32, 24))
    dead = {"MRC_REDIS_URL": _dead_url("redis") + "/0", "MRC_S3_ENDPOINT_URL": _dead_url("http")}
    done = services.run_cli(
        {**env, **dead}, "submit", "--image", str(image), "--prompt", "Refund?", option, value, timeout=30
    )
    assert done.returncode == 2, done.stderr
    assert named in done.stderr


def test_an_image_in_a_bucket_the_workers_may_not_read_is_exit_2_before_anything_is_queued(
    env: dict[str, str],
) -> None:
    """Review: `mrc submit` queued it (exit 0), for the worker to fail it `image_source_forbidden`."""
    dead = {"MRC_REDIS_URL": _dead_url("redis") + "/0", "MRC_S3_ENDPOINT_URL": _dead_url("http")}
    done = services.run_cli({**env, **dead}, "submit", "--image", "s3://elsewhere/x.jpg", "--prompt", "hi?")
    assert done.returncode == 2, done.stderr
    assert "image_source_forbidden" in _one_line(done.stderr)


class _RefusingS3(http.server.BaseHTTPRequestHandler):
    """What S3 answers a role without s3:CreateBucket for a misspelt bucket: no such bucket, and
    AccessDenied to its creation."""

    def do_HEAD(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    answer = (403, b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>")

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, body = self.answer
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT

    def log_message(self, *_args: object) -> None:
        return None


def test_a_bucket_s3_refuses_to_make_is_exit_5_and_a_worker_says_so_before_loading(
    env: dict[str, str], redis_service: services.Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: a traceback and exit 1 from `mrc submit`; the worker loaded its model first, then died."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RefusingS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        refusing = {**env, "MRC_S3_ENDPOINT_URL": f"http://127.0.0.1:{server.server_address[1]}"}
        photo = tmp_path / "parcel.jpg"
        photo.write_bytes(imagegen.photo(32, 32))
        done = services.run_cli(refusing, "submit", "--image", str(photo), "--prompt", "hi?", timeout=60)
        assert done.returncode == 5, done.stderr
        assert "AccessDenied" in _one_line(done.stderr)
        worker = _worker(refusing)
        assert worker.returncode == 5, worker.stderr
        assert "AccessDenied" in worker.stderr
        assert "MRC_MODEL_LOADED" not in worker.stdout + worker.stderr
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
            monkeypatch.setenv(name, env[name])
        with TestClient(create_app(services.settings_from_env(refusing))) as api:
            files = {"image": ("p.jpg", photo.read_bytes(), "image/jpeg")}
            reply = api.post("/v1/jobs", files=files, data={"prompt": "hi?"})
        # A person must act: not 503 and "retry later" (review: it read as an outage)
        assert (reply.status_code, reply.json()["error"]["code"]) == (500, "internal_error"), reply.text
    finally:
        server.shutdown()
        server.server_close()


def test_a_port_already_taken_is_exit_2_naming_its_setting(env: dict[str, str]) -> None:
    """Review: a second worker on a host died with a traceback (exit 1); mrc-api logged that it was
    listening, then exited 3."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        worker = _worker({**env, "MRC_METRICS_PORT": port})
        api = subprocess.run(
            [str(services.BIN / "mrc-api")], env={**env, "MRC_API_HOST": "127.0.0.1", "MRC_API_PORT": port},
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert worker.returncode == 2, worker.stderr
    assert "MRC_METRICS_PORT" in worker.stderr
    assert "MRC_MODEL_LOADED" not in worker.stdout + worker.stderr
    assert api.returncode == 2, api.stderr
    assert "MRC_API_PORT" in api.stderr
    assert "MRC_HTTP_LISTENING" not in api.stdout + api.stderr
    helped = subprocess.run(
        [str(services.BIN / "mrc-api"), "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (helped.returncode, helped.stdout.startswith("usage: mrc-api")) == (0, True), helped.stderr


def _keep_this_process_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's main, called in this process, leaves the test session's log set-up as it is: it
    would point every later log line at this test's captured stderr, closed once it ends (CI: later
    tests of the process failed writing their logs)."""
    from workers import cli as worker_cli

    monkeypatch.setattr(worker_cli.logs, "configure", lambda *_args, **_kwargs: None)


@pytest.mark.parametrize("model", ["nonexistent/model", "{tmp}", "/nonexistent/model", "{tmp}/photo.png"])
def test_a_model_that_cannot_be_loaded_is_exit_2_in_one_line(
    env: dict[str, str],
    tmp_path: Path,
    model: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Review: 40 lines of traceback and exit 1 for a model name that is not there, or a folder that
    holds no model. In this process (a worker's imports cost seconds): its main, as the script runs it."""
    from workers import cli as worker_cli

    (tmp_path / "photo.png").write_bytes(b"\x89PNG\r\n")  # a file, not a model (review: exit 70)
    for name, value in {**env, "MRC_MODEL": model.format(tmp=tmp_path)}.items():
        monkeypatch.setenv(name, value)
    _keep_this_process_logging(monkeypatch)
    assert worker_cli.main([]) == 2
    said = capsys.readouterr().err
    assert "Traceback" not in said
    assert "MRC_MODEL" in next(line for line in said.splitlines() if "bad settings" in line)


def test_a_reader_that_leaves_early_ends_no_command_in_a_traceback(env: dict[str, str]) -> None:
    """Review: `mrc ... --json | head -c 300` ended in a BrokenPipeError traceback; what is written after
    the reader left is dropped and the command ends with its own exit code."""
    proc = subprocess.Popen(
        [str(services.BIN / "mrc"), "queues", "--json"], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the first byte
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert b"Traceback" not in err


@pytest.mark.parametrize(
    ("exc", "settings_fault"),
    [
        (FileNotFoundError("no such file: /models/fuyu"), True),
        (OSError("/models/x does not appear to have a file named config.json"), True),
        # an absolute path that is not there: transformers' OSError over huggingface_hub's ValueError
        (OSError("Repo id must be in the form 'repo_name' or 'namespace/repo_name': '/models/x'"), True),
        (OSError("It looks like the config file at '/models/x.png' is not a valid JSON file."), True),
        (PermissionError("permission denied: /models/fuyu/model.safetensors"), False),
        (OSError(28, "No space left on device"), False),
        (ConnectionError("the hub could not be reached"), False),
    ],
)
def test_a_model_load_is_bad_settings_only_where_the_setting_names_no_model(
    exc: OSError, settings_fault: bool
) -> None:
    """Review: every OSError of a load (a full disk, a permission, the network) exited 2 as bad settings;
    those are the machine's (exit 70, as an unusable worker's)."""
    from workers import cli as worker_cli

    assert worker_cli._names_no_model(exc) is settings_fault


def test_a_model_the_machine_cannot_read_exits_70_through_the_real_backend(
    env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review: the Fuyu backend wraps the OSError it meets in a ModelError, so a permission fault still
    read as bad settings (exit 2)."""
    import transformers

    from workers import cli as worker_cli

    def denied(*_args: object, **_kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(tmp_path / "preprocessor_config.json"))

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", denied)
    for name, value in {**env, "MRC_MODEL": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    _keep_this_process_logging(monkeypatch)
    assert worker_cli.main([]) == 70
    said = capsys.readouterr().err
    assert "Permission denied" in said
    assert "bad settings" not in said


def test_the_port_check_resolves_the_host_as_uvicorn_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: the socket family was chosen by a `:` in MRC_API_HOST, so a name resolving to IPv6 only
    exited 2 where uvicorn would have served it."""
    from producer.server import _port_problem

    resolve = socket.getaddrinfo

    def v6_only(host: str, *args: object, **kwargs: object) -> object:
        return resolve("::1" if host == "api.v6only.test" else host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", v6_only)
    assert _port_problem("api.v6only.test", 0) is None
    assert _port_problem("::1", 0) is None
    # Every address one process binds is tried (review: only the first, ::1 of a name resolving to
    # ::1 then 127.0.0.1, and a taken 127.0.0.1 passed); several processes bind IPv4 for a name.
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *args, **kwargs: [
        *resolve("::1", *args, **kwargs), *resolve("127.0.0.1", *args, **kwargs)
    ])  # fmt: skip
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert _port_problem("api.both.test", port) is not None
        assert _port_problem("127.0.0.1", port, workers=2) is not None


class _SlowS3(_RefusingS3):
    answer = (
        400,
        b"<Error><Code>RequestTimeout</Code><Message>Your socket connection timed out</Message></Error>",
    )


def test_a_bucket_s3_could_not_make_now_is_an_outage_not_a_refusal(env: dict[str, str]) -> None:
    """Review: every client error making the bucket read as a refusal for good, S3's 400 RequestTimeout
    (a slow upload of the request) too: mrc-api answered 500, `mrc backlog` gave up at once."""
    from shared.errors import StoreUnavailable
    from shared.stores.s3 import S3Connection

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        slow = {**env, "MRC_S3_ENDPOINT_URL": f"http://127.0.0.1:{server.server_address[1]}"}
        connection = S3Connection(services.settings_from_env(slow), attempts=1)
        with pytest.raises(StoreUnavailable, match="RequestTimeout"):
            connection.ensure_bucket("mrc-slow")
        connection.close()
    finally:
        server.shutdown()
        server.server_close()


def test_the_lane_exporter_on_a_taken_port_is_one_line_and_exit_2(env: dict[str, str]) -> None:
    """Review: `mrc queues --serve-metrics PORT` on a port already in use ended in an OSError traceback."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        done = services.run_cli(env, "queues", "--serve-metrics", str(taken.getsockname()[1]), timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "--serve-metrics" in _one_line(done.stderr)


def test_a_stored_result_is_printed_with_redis_away_and_none_yet_needs_redis(env: dict[str, str]) -> None:
    """Review: `mrc result` said "no result yet" (exit 3) with Redis away; then (helper-61) it refused a
    result S3 holds. The result is read from S3 alone; "none yet" is said only where Redis answers."""
    import boto3

    s3 = boto3.client(
        "s3", endpoint_url=env["MRC_S3_ENDPOINT_URL"], region_name="us-east-1",
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )  # fmt: skip
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
        s3.create_bucket(Bucket=env["MRC_S3_BUCKET"])
    stored = {"schema": "mrc.result/1", "job_id": "stored-1", "status": "succeeded", "text": "yes"}
    s3.put_object(
        Bucket=env["MRC_S3_BUCKET"], Key=f"{env.get('MRC_S3_PREFIX', '')}results/stored-1.json",
        Body=json.dumps(stored).encode(),
    )  # fmt: skip
    away = {**env, "MRC_REDIS_URL": _dead_url("redis") + "/0"}
    done = services.run_cli(away, "result", "stored-1", timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["text"] == "yes"
    done = services.run_cli(away, "result", "not-stored", timeout=30)
    assert done.returncode == 5, done.stderr
    assert "Redis" in _one_line(done.stderr)
