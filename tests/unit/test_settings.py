from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.settings import BadSettings, Settings, load


def test_defaults_match_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("MRC_"):
            monkeypatch.delenv(name)
    s = Settings()
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert (s.s3_endpoint_url, s.s3_bucket, s.s3_prefix) == ("", "mrc", "")
    assert (s.model, s.quantization, s.device) == ("adept/fuyu-8b", "nf4", "auto")
    assert (s.metrics_port, s.cache_ttl_s) == (9400, 86400)


def test_environment_is_read_with_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MRC_S3_PREFIX", "tenant-a")
    monkeypatch.setenv("MRC_QUANTIZATION", "bf16")
    monkeypatch.setenv("MRC_ALLOWED_BUCKETS", '["photos"]')
    s = Settings()
    assert s.s3_prefix == "tenant-a/"
    assert s.quantization == "bf16"
    assert s.readable_buckets == frozenset({"mrc", "photos"})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MRC_QUANTIZATION", "int3"),
        ("MRC_DEVICE", "tpu"),
        ("MRC_MAX_NEW_TOKENS_DEFAULT", "0"),
        ("MRC_BATCH_MAX_JOBS", "0"),
        ("MRC_MODEL_BATCH_MAX_JOBS", "0"),
        ("MRC_MAX_ATTEMPTS", "0"),
        ("MRC_FETCH_THREADS", "-1"),
        ("MRC_LOG_LEVEL", "VERBOSE"),
        ("MRC_METRICS_PORT", "65536"),
        ("MRC_REDIS_URL", "redis://127.0.0.1:99999/0"),
        ("MRC_REDIS_URL", "127.0.0.1:6379"),
        ("MRC_REDIS_URL", "redis://127.0.0.1:6379/zero"),
        ("MRC_S3_ENDPOINT_URL", "minio:9000"),
        ("MRC_RETRY_BASE_S", "120"),
        ("MRC_REDIS_URL", "unix:///run/redis.sock"),  # passed, then the broker failed uncaught
        ("MRC_REDIS_WAIT_TIMEOUT_MS", "60000"),  # past the socket timeout: the push would be retried
        ("MRC_ENGINE_PREFILL_TOKENS", "8"),  # less than a block of the prefix cache
        ("MRC_ENGINE_PREFILL_TOKENS", "half"),
        # Review (helper-60): each of these was taken, then failed at runtime or with a traceback
        ("MRC_API_WORKERS", "99999999999999999999999"),  # mrc-api started processes until OOM
        ("MRC_EVENTS_MAX", "99999999999999999999999"),  # every XADD failed: events lost
        ("MRC_CACHE_TTL_S", "99999999999999999999999"),  # every cache write failed
        ("MRC_BATCH_WAIT_MS", "99999999999"),  # a lone job never ran
        ("MRC_VISIBILITY_TIMEOUT_S", "99999999999999999999999"),
        ("MRC_STUCK_AFTER_S", "inf"),
        ("MRC_RETRY_MAX_S", "1e300"),
        ("MRC_S3_REGION", "-1"),  # botocore's InvalidRegionError, a traceback
        ("MRC_S3_REGION", "0"),
        ("MRC_S3_BUCKET", ""),  # "cannot reach S3" (exit 5) for a bad setting
        ("MRC_S3_BUCKET", "a b"),
        ("MRC_ALLOWED_BUCKETS", '["a b"]'),
        ("MRC_S3_ENDPOINT_URL", "http://127.0.0.1:99999"),
        ("MRC_REDIS_URL", "redis://127.0.0.1:6379/0?socket_timeout=abc"),  # a traceback at connect
        ("MRC_REDIS_URL", "redis://127.0.0.1:6379/0?bogus=1"),  # review, helper-73: a traceback too
        ("MRC_REDIS_URL", "rediss://127.0.0.1:6379/0?ssl_ca_cert=/ca.pem"),  # misspelt: a traceback
        ("MRC_REDIS_URL", "redis://127.0.0.1:6379/0?protocol=9"),  # exit 5, "cannot reach Redis"
        ("MRC_REDIS_URL", "redis://127.0.0.1:6379/0?socket_timeout=2"),  # review, helper-75: the broker
        ("MRC_REDIS_URL", "redis://127.0.0.1:6379/0?health_check_interval=10"),  # failed at its publish
        ("MRC_ALLOWED_BUCKETS", ""),  # not JSON: pydantic-settings' SettingsError, a traceback
        ("MRC_ALLOWED_BUCKETS", "nan"),
        # Review, helper-90: str.isdigit took Unicode digits, which int() then failed on or read
        ("MRC_REDIS_URL", "redis://127.0.0.1:6379/\u00b2"),
        ("MRC_REDIS_SENTINELS", "10.0.0.5:\u00b2"),
        ("MRC_REDIS_SENTINELS", "10.0.0.5:" + "0" * 5000 + "80"),
        ("MRC_DEVICE", "cuda:\u00b2"),
    ],
)
def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(BadSettings) as refused:
        load()
    assert name in str(refused.value)
    assert "\n" not in str(refused.value)


def test_every_number_setting_is_bounded_and_finite() -> None:
    """The whole class: no number setting takes a value past what its users (Redis, timers, process
    counts) can hold, whatever its own bounds say."""
    for name, field in Settings.model_fields.items():
        if field.annotation not in (int, float):
            continue
        for value in ("1e30", "inf", "-inf", "nan") if field.annotation is float else ("10" * 14,):
            with pytest.raises(ValidationError):
                Settings(**{name: value})


def test_a_bound_of_a_settings_own_is_kept_and_byte_counts_go_past_two_gib() -> None:
    """Review (helper-61): the ceiling for every number refused the 5 GiB MRC_OPENAI_FILE_MAX_BYTES
    allows (and README documents), and 4 GiB of MRC_API_DRAIN_BYTES."""
    assert Settings(openai_file_max_bytes=5 * 1024**3).openai_file_max_bytes == 5 * 1024**3
    assert Settings(api_drain_bytes=4 * 1024**3).api_drain_bytes == 4 * 1024**3
    with pytest.raises(ValidationError):
        Settings(openai_file_max_bytes=5 * 1024**3 + 1)
    with pytest.raises(ValidationError):  # past the 7 days a job's record lives, its batch would vanish
        Settings(openai_batch_window_s=8 * 86_400)


def test_the_fixed_decode_step_is_refused_with_flash_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    # flash-attention reads a mask as 2-D padding: the fixed step's 4-D mask would be misread.
    monkeypatch.setenv("MRC_ATTENTION", "flash_attention_2")
    for decode in ("fixed", "pool"):
        monkeypatch.setenv("MRC_ENGINE_DECODE", decode)
        with pytest.raises(ValidationError, match="flash_attention_2"):
            Settings()
    monkeypatch.setenv("MRC_ENGINE_DECODE", "auto")
    from workers.backends.fuyu import FuyuBackend

    backend = FuyuBackend(Settings(device="cpu"))
    backend.device = "cuda"  # what auto picks there, without a GPU: rows with flash-attention
    assert backend.decode_mode() == "rows"


def test_errors_name_the_variable_and_hide_passwords(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.settings import describe_error

    monkeypatch.setenv("MRC_REDIS_URL", "http://:hunter2@redis.internal:6379/0")
    with pytest.raises(ValidationError) as caught:
        Settings()
    text = describe_error(caught.value)
    assert text.startswith("MRC_REDIS_URL=")
    assert "hunter2" not in text
    assert "\n" not in text


def test_unknown_mrc_variables_are_listed() -> None:
    from shared.settings import unknown_variables

    env = {"MRC_BATCH_MAX_JOB": "4", "MRC_HOME": "/x", "MRC_LOG_LEVEL": "info", "HOME": "/root"}
    assert unknown_variables(env) == ["MRC_BATCH_MAX_JOB"]


@pytest.mark.parametrize(
    ("value", "device", "chunk"),
    [
        (None, "cpu", 512),
        ("auto", "cuda", 1024),
        ("auto", "cuda:1", 1024),
        ("768", "cuda", 768),
        ("64", "cpu", 64),
    ],
)
def test_the_prefill_chunk_is_the_setting_or_by_the_device(
    monkeypatch: pytest.MonkeyPatch, value: str | None, device: str, chunk: int
) -> None:
    from workers.engine import capacity

    if value is None:
        monkeypatch.delenv("MRC_ENGINE_PREFILL_TOKENS", raising=False)
    else:
        monkeypatch.setenv("MRC_ENGINE_PREFILL_TOKENS", value)
    assert capacity.prefill_tokens(Settings().engine_prefill_tokens, device) == chunk


def test_settings_load_where_redis_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU proving ground's machine has no redis package (its bundle carries none): checking the
    Redis URL's options with redis-py's parser made every settings load there fail (make gpu-smoke)."""
    import sys

    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.setitem(sys.modules, "redis.connection", None)
    assert Settings(redis_url="rediss://127.0.0.1:6379/0?ssl_cert_reqs=none").redis_url.startswith(
        "rediss://"
    )
